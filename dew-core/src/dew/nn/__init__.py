"""Neural-network building blocks that name their parameters' logical axes.

Array names end in their shape, one lowercase letter per dimension (as
nanodo writes them), so an einsum reads against its operands: ``q_bthk``
is [batch, tokens, heads, head width]. The letters: b batch, t tokens
(queries), s positions (keys), d model width, h heads, k head width, m mlp
width, v vocabulary, e experts, l layers, f frames, y image rows, x image
columns, c channels, p patches, g key/value head groups, n any other count.

A module's arguments, attributes, submodule and parameter names keep their
plain words (``x``, ``tokens``, ``num_heads``, ``"query"``): callers pass them
by keyword, and checkpoints and exported weights are read by them. A body
names an argument again with its shape (``x_btd = x``) before working on it.
"""

__path__ = __import__("pkgutil").extend_path(__path__, __name__)  # noqa: F821
