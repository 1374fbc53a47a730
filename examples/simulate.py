"""All 16 nodes stacked on one device (the default backend).

Run: python examples/simulate.py
"""

import jax

import _problem as p
import gossipjax as gj


def main():
  backend = gj.backend.simulate()  # the default: same as leaving backend out
  tx = p.optimizer(backend)
  x, a, b = p.data()
  state = tx.init(x)
  step = jax.jit(p.make_step(tx, backend))
  for _ in range(p.STEPS):
    x, state = step(x, state, a, b)
  p.report("simulate", x, a, b)


if __name__ == "__main__":
  main()
