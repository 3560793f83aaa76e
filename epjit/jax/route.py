"""How a call site (epjit.ops.xla) becomes an operation of an XLA program: the one interface every route takes, and
the route built, ``jax.experimental.buffer_callback``.

A route takes a site and the call's JAX arrays and returns the site's outputs as JAX arrays, allocated by XLA. The
site launches on the stream XLA gives the callback, into XLA's buffers, and allocates nothing; with
``command_buffer_compatible=True`` XLA captures that launch into the CUDA graph of its command buffer and calls the
callback again only when some buffer's address changed, so the launch must not depend on how often the callback
runs: everything a site decides is fixed when it is built, at trace time.

``has_side_effect=True``: dispatch and combine are collectives. XLA must neither drop one whose outputs go unused on
some path nor run two of them concurrently or in another order than the program's (every rank runs the same
sequence of calls, which the low-latency buffer sets and the normal-mode rings rely on).

The other route, an XLA FFI handler over ctypes (``jax.ffi.register_ffi_target`` of a ``CFUNCTYPE`` over
``XLA_FFI_CallFrame``, called through ``jax.ffi.ffi_call``), is not built: it would take the same sites behind this
same interface, should buffer_callback be withdrawn (docs/jax.md).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.experimental.buffer_callback import buffer_callback

_DTYPES = {"bfloat16": jnp.bfloat16, "uint8": jnp.uint8, "int32": jnp.int32, "float32": jnp.float32}


class Route(Protocol):
    def __call__(self, site: Any, *args: Any) -> list[Any]:
        """The site's outputs, as JAX arrays, of one launch over ``args``."""
        ...


def out_types(site: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
    """What XLA allocates for a site: its outputs (scratch included), by shape and dtype name."""
    return tuple(jax.ShapeDtypeStruct(shape, _DTYPES[dtype]) for shape, dtype in site.outputs)


class BufferCallbackRoute:
    """The site as a ``buffer_callback``: the callback is the site's launch, fixed per call site."""

    def __call__(self, site: Any, *args: Any) -> list[Any]:
        call = buffer_callback(site.launch, out_types(site), has_side_effect=True, command_buffer_compatible=True)
        return list(call(*args))


ROUTE: Route = BufferCallbackRoute()
