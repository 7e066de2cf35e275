"""Compressed collectives: ``all_gather``, ``reduce_scatter`` and ``all_reduce`` with a codec.

Pure functions for code running inside ``jax.shard_map`` (or ``jax.pmap``) over a mesh
axis: optax transforms, optimizers, and model code alike. Each takes a pytree of arrays
and a codec (any commjax compressor that encodes a vector into uint32 words;
``None`` or [`commjax.identity`][] is the exact collective of ``jax.lax``) and returns
the *decoded* result, which is identical on every replica of the axis::

    from commjax import collectives as cc
    full  = cc.all_gather(shard, "data", cj.quantize(bits=8, stochastic=False))
    chunk = cc.reduce_scatter(grad, "data", cj.quantize(bits=4), key=key, mean=True)
    total = cc.all_reduce(grad, "data", cj.sign())

``cj.communication_plan(cc.all_gather, x, N, codec=...)`` (likewise ``reduce_scatter``,
``all_reduce``) gives what an op sends without compiling, equal to the compiled HLO's.

Semantics, for replica ``r`` of ``N``, codec ``C`` (``C(x) = decode(encode(x))``):

==================  ====================================================  ===========================
collective          result on every replica                               bytes sent per device
==================  ====================================================  ===========================
``all_gather``      ``concat_r C(x_r)`` (tiled along axis 0)              ``(N-1) P``
``reduce_scatter``  chunk ``r`` of ``sum_s C(x_s)``, summed in replica    ``(N-1)/N * N P_c``
                    order in fp32 (each chunk encoded on its own)         (one all-to-all)
``all_reduce``      ``sum_s C(x_s)`` by the chosen reducer (below)        see ``Reducer``
==================  ====================================================  ===========================

``P`` is one replica's payload (``4 * payload_words``), ``P_c`` that of one chunk, each
padded to whole TPU tiles: a reduce-scatter's rows of words and exact 1-D chunks to
multiples of 1,024 from 16,384 on (``shard_width``; an exact reduce-scatter's chunk further
to ``scatter_width``), an all-gather's row of words to multiples of 128 while
the gathered rows take at most 8 MB (a TPU compiles other shapes as an all-reduce of twice
the bytes; ``commjax/collectives/_common.py``). Payloads
travel as unsigned 32-bit words (XLA on CPU widens 16- and 8-bit float collectives) and
quantized codes are never summed by a collective (``psum`` on small integers wraps
around): each replica decodes what it receives and sums in fp32 itself.

Layouts: leaves are flattened; each leaf (or, for ``reduce_scatter``, each leaf's chunk
of ``size / N`` elements) is padded with zeros to the codec's alignment (whole blocks), so
no block spans two leaves or two chunks. All leaves travel in one collective. Integer,
boolean and complex leaves take the exact collective of ``jax.lax``; a sum counts
booleans in int32, as ``lax.psum`` does (``reduce_scatter`` too, which ``lax.psum_scatter``
refuses).

Randomness: ``key`` is a PRNG key that is the *same* on every replica; stochastic codecs
fold in the replica index themselves, so their rounding noise differs per replica.

Differentiation: the VJP of a compressed ``all_gather`` is a compressed ``reduce_scatter``
of the cotangent with ``grad_codec`` (``None``: exact), and vice versa; ``all_reduce``'s
VJP is an ``all_reduce``. Under ``shard_map(check_vma=True)`` a cotangent that is typed
replicated needs no communication (as JAX's own rules do): the VJP of ``all_gather`` is
then this replica's slice of it.

Hierarchical pairs (``inner_axis_name``): a fast axis (NVLink, ICI) inside a slow one
(DCN). ``reduce_scatter`` scatters over the inner axis first (``inner_codec``, exact by
default), then over the outer axis (``codec``); ``all_gather`` is its inverse (outer, then
inner). Device ``(o, i)`` holds global chunk ``i * O + o``. ``all_reduce`` takes the
exact mean over the inner axis, then the compressed one over the outer axis.
"""

from commjax.collectives.gather import all_gather
from commjax.collectives.scatter import reduce_scatter
from commjax.collectives.reduce import all_reduce
from commjax.collectives.permute import PermuteDelta, delta_state, inject_residual, ppermute
from commjax.collectives.tensor_parallel import tp_copy, tp_reduce
from commjax.collectives import _bytes  # noqa: F401  (attaches each op's plan)
from commjax.collectives._reducers import REDUCERS, valid_reducers

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "ppermute", "delta_state", "PermuteDelta",
           "inject_residual", "tp_copy", "tp_reduce", "REDUCERS", "valid_reducers"]
