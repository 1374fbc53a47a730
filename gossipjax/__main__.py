from gossipjax.cli import main

main()
