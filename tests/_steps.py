"""A transform run for some steps in one jitted ``lax.scan``: the trajectories tests compare to references."""

import jax
import jax.numpy as jnp
import numpy as np
import optax


def scan_steps(tx, x0, grad_fn, steps):
  """``(x^1..x^steps, the last state)`` of ``tx`` from ``x0``, with gradients ``grad_fn(x)``."""

  def body(carry, _):
    x, state = carry
    updates, state = tx.update(grad_fn(x), state, x)
    x = optax.apply_updates(x, updates)
    return (x, state), x

  x0 = jnp.asarray(x0)
  (_, state), xs = jax.jit(lambda c: jax.lax.scan(body, c, None, steps))((x0, tx.init(x0)))
  return np.asarray(xs), state
