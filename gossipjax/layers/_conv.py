"""A per-node convolution whose gradients map over nodes as matrix products.

``vmap`` over nodes turns a convolution into grouped convolutions (one group per node), its weight gradient into
one whose window is the whole image. XLA:GPU runs that weight gradient as a forward cuDNN convolution at a fraction
of the speed of a backward-filter kernel; written as one matrix product per kernel offset, contracting the batch and
the space of the shifted, padded input against the output cotangent (the *shifted* form), it maps over nodes as
batched matrix products. XLA:CPU runs every grouped convolution slowly; there the whole convolution is one matrix
product of the input's patches against the flattened kernel (the *patches* form). Both keep only the input and the
kernel for the backward pass (``jax.checkpoint``) and recompute the shifted slices there.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from typing import Any, Literal, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

WEIGHT_GRADS = ("auto", "shifted", "patches", "xla")
PADDINGS = ("SAME", "SAME_LOWER", "VALID")
_LOW_PRECISION = (jnp.bfloat16, jnp.float16)
_NAME = "gj.layers.conv_general_dilated"
# ``auto`` writes a convolution as matrix products only up to this many kernel offsets (3x3): past it (a 7x7 stem)
# the products' count makes the program slow to compile for little gain, and XLA's own form is kept.
_MAX_OFFSETS = 9


def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: lax.PrecisionLike = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
    *,
    weight_grad: Literal["auto", "shifted", "patches", "xla"] = "auto",
) -> jax.Array:
  """``jax.lax.conv_general_dilated`` with gradients that map over nodes at the platform's speed.

  In the shifted form (the default on a GPU), the value, the forward pass and the gradient with respect to ``lhs``
  are XLA's. The tangent in ``rhs`` (the kernel) is written as a sum over kernel offsets of matrix products of the shifted, padded input against the
  kernel's slice at that offset, so that reverse mode transposes it into the weight gradient

  .. math::

     \\frac{\\partial L}{\\partial w_{k}} = \\sum_{b,\\,s} x^{\\text{pad}}_{b,\\ s \\cdot \\text{stride} + k}
     \\otimes \\frac{\\partial L}{\\partial y_{b,\\,s}},

  one matrix product per offset ``k`` contracting batch and space, where XLA's own transpose is a convolution whose
  window is the whole image. Under ``jax.vmap`` over nodes these become batched matrix products; XLA's form becomes
  a grouped convolution (``feature_group_count`` = nodes) that XLA:GPU runs as a slow forward cuDNN kernel. The
  backward pass keeps the input, not one shifted slice of it per offset: the slices are recomputed there
  (``jax.checkpoint``), so reverse mode saves what XLA's own convolution saves.

  In the patches form (the default on a CPU), the whole convolution is one matrix product of the input's patches
  (its shifted slices side by side in the feature dimension) against the kernel flattened to (offsets x input
  features, output features). Its derivatives are those of plain ``lax`` operations: under ``jax.vmap`` over nodes
  every one of them is a batched matrix product, where XLA:CPU runs the grouped convolutions of XLA's form at a
  fraction of the speed of one convolution per node. The patches are recomputed in the backward pass, not saved.

  Forward mode works in every form: the shifted one is a ``jax.custom_jvp`` whose tangent is linear in both
  arguments, so ``jax.jvp``, ``jax.linearize``, ``jax.jacfwd``, ``jax.hessian`` and higher derivatives go through it.
  Low precision in the shifted form (bfloat16, float16 inputs without a ``preferred_element_type``): each offset's
  product is a 16-bit
  matrix product, which a GPU's matrix units accumulate in float32, the sum over offsets is in float32, and the
  weight gradient comes back in the kernel's dtype. (A float32 ``preferred_element_type`` on the products would
  turn the weight gradient into a float32 x float32 product, the 16-bit operands cast up.) With a
  ``preferred_element_type``, the products accumulate in it.

  Where there is no such form (``lhs_dilation`` or ``rhs_dilation`` other than 1, ``feature_group_count`` or
  ``batch_group_count`` above 1, or an ``out_sharding``), this is exactly ``lax.conv_general_dilated``.

  Args:
    lhs: the input, with 1, 2 or 3 spatial dimensions.
    rhs: the kernel.
    window_strides: the strides, one per spatial dimension.
    padding: ``"SAME"``, ``"SAME_LOWER"``, ``"VALID"`` or explicit ``(low, high)`` pairs.
    lhs_dilation: as for ``jax.lax.conv_general_dilated``.
    rhs_dilation: as for ``jax.lax.conv_general_dilated``.
    dimension_numbers: any of ``jax.lax.conv_general_dilated``'s (``("NHWC", "HWIO", "NHWC")`` in flax).
    feature_group_count: as for ``jax.lax.conv_general_dilated``.
    batch_group_count: as for ``jax.lax.conv_general_dilated``.
    precision: as for ``jax.lax.conv_general_dilated``; the matrix products take it too.
    preferred_element_type: as for ``jax.lax.conv_general_dilated``; the matrix products accumulate in it.
    out_sharding: as for ``jax.lax.conv_general_dilated``.
    weight_grad: ``"auto"`` (the default) chooses when the program is lowered: for a kernel of at most 9 offsets
      (3x3, 1x1, 3x1, ...), the shifted form on ``cuda`` and ``rocm`` and the patches form on ``cpu``; XLA's
      form for larger kernels (a 7x7 stem, whose 49 products compile slowly for little gain) and on every other
      platform. ``"shifted"``, ``"patches"`` or ``"xla"`` (``lax.conv_general_dilated`` itself) forces one.

  Returns:
    The convolution, equal to ``lax.conv_general_dilated``'s.

  Example:
    A drop-in replacement in flax: ``nn.Conv(..., conv_general_dilated=gj.layers.conv_general_dilated)``
    (linen) or ``nnx.Conv(..., conv_general_dilated=gj.layers.conv_general_dilated, rngs=rngs)`` (NNX).

    >>> import jax, jax.numpy as jnp
    >>> import gossipjax as gj
    >>> x = jnp.ones((2, 8, 8, 3)); w = jnp.ones((3, 3, 3, 4))
    >>> conv = lambda w: gj.layers.conv_general_dilated(
    ...     x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), weight_grad="shifted")
    >>> ref = lambda w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    >>> bool(jnp.allclose(jax.grad(lambda w: conv(w).sum())(w), jax.grad(lambda w: ref(w).sum())(w)))
    True
  """
  if weight_grad not in WEIGHT_GRADS:
    raise ValueError(f"{_NAME}: weight_grad must be one of {WEIGHT_GRADS}, got {weight_grad!r}")
  spatial = len(lhs.shape) - 2
  window_strides = _positive_ints(window_strides, "window_strides", spatial)
  padding = _checked_padding(padding, spatial)
  lhs_dilation = None if lhs_dilation is None else _positive_ints(lhs_dilation, "lhs_dilation", spatial)
  rhs_dilation = None if rhs_dilation is None else _positive_ints(rhs_dilation, "rhs_dilation", spatial)
  xla = functools.partial(
      lax.conv_general_dilated, window_strides=window_strides, padding=padding, lhs_dilation=lhs_dilation,
      rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers, feature_group_count=feature_group_count,
      batch_group_count=batch_group_count, precision=precision, preferred_element_type=preferred_element_type,
      out_sharding=out_sharding)
  plain = (feature_group_count != 1 or batch_group_count != 1 or out_sharding is not None
           or any(d != 1 for d in (lhs_dilation or ())) or any(d != 1 for d in (rhs_dilation or ())))
  if weight_grad == "xla" or plain:
    return xla(lhs, rhs)
  spec = _spec(lhs.shape, rhs.shape, tuple(window_strides), padding, dimension_numbers)
  if any(n < 1 for n in spec[-1]):  # an empty output: nothing to multiply
    return xla(lhs, rhs)
  shifted = _shifted_conv(spec, _hashable(precision), preferred_element_type)
  patches = _patches_conv(spec, _hashable(precision), preferred_element_type)
  if weight_grad == "shifted":
    return shifted(lhs, rhs)
  if weight_grad == "patches":
    return patches(lhs, rhs)
  if math.prod(spec[-2]) > _MAX_OFFSETS:
    return xla(lhs, rhs)
  return lax.platform_dependent(lhs, rhs, cuda=shifted, rocm=shifted, cpu=patches, default=xla)


def _integers(value: Any) -> tuple[int, ...] | None:
  """``value`` as a tuple of ints (anything ``operator.index`` reads, as lax does); ``None`` if it is not one."""
  if isinstance(value, str):
    return None
  try:
    return tuple(operator.index(v) for v in value)
  except TypeError:
    return None


def _positive_ints(value: Any, arg: str, spatial: int) -> tuple[int, ...]:
  """Strides or dilations: one positive integer per spatial dimension."""
  entries = _integers(value)
  want = f"a sequence of {spatial} positive integers, one per spatial dimension"
  if entries is None:
    raise TypeError(f"{_NAME}: {arg} must be {want}, got {value!r}")
  if len(entries) != spatial or any(e < 1 for e in entries):
    raise ValueError(f"{_NAME}: {arg} must be {want}, got {value!r}")
  return entries


def _checked_padding(padding: Any, spatial: int) -> str | tuple[tuple[int, int], ...]:
  """A padding name (any case, as lax reads it), or one ``(low, high)`` pair of integers per spatial dimension."""
  want = f"one of {PADDINGS} or a sequence of {spatial} (low, high) pairs of integers, one per spatial dimension"
  if isinstance(padding, str):
    if padding.upper() not in PADDINGS:
      raise ValueError(f"{_NAME}: padding must be {want}, got {padding!r}")
    return padding
  try:
    pairs = [_integers(pair) for pair in padding]
  except TypeError:  # not a sequence at all (an int)
    pairs = [None]
  if any(pair is None for pair in pairs):
    raise TypeError(f"{_NAME}: padding must be {want}, got {padding!r}")
  pads = tuple((pair[0], pair[1]) for pair in pairs if pair is not None and len(pair) == 2)
  if len(pads) != spatial or len(pads) != len(pairs):
    raise ValueError(f"{_NAME}: padding must be {want}, got {padding!r}")
  return pads


def _spec(lhs_shape, rhs_shape, strides, padding, dimension_numbers):
  """The geometry, normalised and hashable: dimension numbers, strides, explicit pads, kernel and output sizes."""
  dn = lax.conv_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers)
  in_sizes = tuple(lhs_shape[d] for d in dn.lhs_spec[2:])
  kernel = tuple(rhs_shape[d] for d in dn.rhs_spec[2:])
  if isinstance(padding, str):
    pads = tuple(lax.padtype_to_pads(in_sizes, kernel, strides, padding))
  else:
    pads = tuple(padding)
  out = tuple((n + lo + hi - k) // s + 1 for n, (lo, hi), k, s in zip(in_sizes, pads, kernel, strides))
  return tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec), strides, pads, kernel, out


def _hashable(precision):
  return tuple(precision) if isinstance(precision, list) else precision


@functools.lru_cache(maxsize=512)
def _shifted_conv(spec, precision, preferred_element_type):
  """The custom_jvp convolution for one geometry: XLA's value, the kernel's tangent as shifted products."""
  lhs_spec, rhs_spec, out_spec, strides, pads, _, _ = spec

  def xla(lhs, rhs):
    return lax.conv_general_dilated(
        lhs, rhs, strides, pads, dimension_numbers=lax.ConvDimensionNumbers(lhs_spec, rhs_spec, out_spec),
        precision=precision, preferred_element_type=preferred_element_type)

  @jax.custom_jvp
  def conv(lhs, rhs):
    return xla(lhs, rhs)

  def jvp(primals, tangents):
    lhs, rhs = primals
    lhs_dot, rhs_dot = tangents
    out = xla(lhs, rhs)
    terms = []
    if not isinstance(lhs_dot, SymbolicZero):
      terms.append(xla(lhs_dot, rhs))
    if not isinstance(rhs_dot, SymbolicZero):
      # Recomputed in the backward pass: the residual is lhs, not one shifted slice of it per kernel offset.
      tangent = functools.partial(_kernel_tangent, spec=spec, precision=precision,
                                  preferred_element_type=preferred_element_type, out_dtype=out.dtype)
      terms.append(jax.checkpoint(tangent)(lhs, rhs_dot))
    return out, functools.reduce(jnp.add, terms) if terms else jnp.zeros_like(out)

  conv.defjvp(jvp, symbolic_zeros=True)
  return conv


@functools.lru_cache(maxsize=512)
def _patches_conv(spec, precision, preferred_element_type):
  """The convolution for one geometry as one matrix product of the input's patches, recomputed in the backward."""
  return jax.checkpoint(functools.partial(_patches, spec=spec, precision=precision,
                                          preferred_element_type=preferred_element_type))


def _patches(lhs, rhs, spec, precision, preferred_element_type):
  """(the input's patches: a strided slice per kernel offset, side by side) @ (the kernel as a matrix).

  In the canonical layouts (batch, space..., feature) and (space..., in, out): the patches' features are ordered
  offset-major, as the kernel's rows are once its spatial and input dimensions are flattened together.
  """
  lhs_spec, rhs_spec, out_spec, strides, pads, kernel, out_sizes = spec
  spatial = len(kernel)
  x = lax.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
  w = lax.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
  x = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0), *((lo, hi, 0) for lo, hi in pads), (0, 0, 0)])
  cols = []
  for offset in itertools.product(*map(range, kernel)):
    limit = (x.shape[0], *(k + (n - 1) * s + 1 for k, n, s in zip(offset, out_sizes, strides)), x.shape[-1])
    cols.append(lax.slice(x, (0, *offset, 0), limit, (1, *strides, 1)))
  patches = cols[0] if len(cols) == 1 else lax.concatenate(cols, spatial + 1)
  out = lax.dot_general(patches, w.reshape(-1, w.shape[-1]), (((spatial + 1,), (0,)), ((), ())),
                        precision=precision, preferred_element_type=preferred_element_type)
  # out is (batch, space..., feature); out_spec says where each of those goes.
  perm = [0] * out.ndim
  perm[out_spec[0]], perm[out_spec[1]] = 0, spatial + 1
  for i, d in enumerate(out_spec[2:]):
    perm[d] = i + 1
  return lax.transpose(out, perm)


def _kernel_tangent(lhs, rhs_dot, spec, precision, preferred_element_type, out_dtype):
  """``conv(lhs, rhs_dot)`` as a sum over kernel offsets of (shifted input) @ (kernel slice).

  Linear in ``rhs_dot``; its transpose, which reverse mode takes, is the weight gradient: per offset, one
  ``dot_general`` of the shifted input against the cotangent contracting batch and space.
  """
  lhs_spec, rhs_spec, out_spec, strides, pads, kernel, out_sizes = spec
  # Low precision: each product keeps the inputs' dtype, so that its transpose (the weight gradient) multiplies
  # two 16-bit operands (the GPU's matrix units accumulate them in float32); the sum over offsets is in float32.
  low = preferred_element_type is None and jnp.dtype(lhs.dtype) in map(jnp.dtype, _LOW_PRECISION)
  config = [(0, 0, 0)] * lhs.ndim
  for d, (lo, hi) in zip(lhs_spec[2:], pads):
    config[d] = (lo, hi, 0)
  padded = lax.pad(lhs, jnp.zeros((), lhs.dtype), config)
  lhs_feature, rhs_in = lhs_spec[1], rhs_spec[1]
  # rhs_dot at one offset keeps its two feature dims in their order; the input feature's place among them:
  w_in = 0 if rhs_in < rhs_spec[0] else 1
  total = None
  for offset in itertools.product(*map(range, kernel)):
    start, limit, step = [0] * lhs.ndim, list(padded.shape), [1] * lhs.ndim
    for d, k, n, s in zip(lhs_spec[2:], offset, out_sizes, strides):
      start[d], limit[d], step[d] = k, k + (n - 1) * s + 1, s
    shifted = lax.slice(padded, start, limit, step)
    w_start, w_limit = [0] * rhs_dot.ndim, list(rhs_dot.shape)
    for d, k in zip(rhs_spec[2:], offset):
      w_start[d], w_limit[d] = k, k + 1
    w = lax.squeeze(lax.slice(rhs_dot, w_start, w_limit), rhs_spec[2:])
    term = lax.dot_general(shifted, w, (((lhs_feature,), (w_in,)), ((), ())),
                           precision=precision, preferred_element_type=preferred_element_type)
    term = term.astype(jnp.float32) if low else term
    total = term if total is None else total + term
  assert total is not None
  # total's dims: lhs's dims but its feature (batch and space, in lhs order), then the output feature.
  kept = [d for d in range(lhs.ndim) if d != lhs_feature]
  role = {lhs_spec[0]: "batch", **{d: i for i, d in enumerate(lhs_spec[2:])}}
  position = {role[d]: i for i, d in enumerate(kept)} | {"feature": lhs.ndim - 1}
  out_roles = [None] * lhs.ndim
  out_roles[out_spec[0]], out_roles[out_spec[1]] = "batch", "feature"
  for i, d in enumerate(out_spec[2:]):
    out_roles[d] = i
  return lax.transpose(total, [position[r] for r in out_roles]).astype(out_dtype)
