"""IndexCache layer patterns: which layers run their own indexer ("full") and which reuse the
top-k of the nearest full layer before them ("shared").

A :class:`LayerPattern` is built from

- a string, one character per layer: ``"FFFSSSF..."`` (``F``/``S``, either case);
- SGLang's frequency rule, ``(layers, freq, offset)`` (:meth:`LayerPattern.from_freq`);
- a list with one entry per layer: ``True``/``False`` (full/shared) or the strings
  ``"full"``/``"shared"`` (as a checkpoint's ``indexer_types`` lists them) or ``"F"``/``"S"``.

:func:`layer_pattern` accepts any of these. The pattern derives the **groups**: every full
layer maps to the consecutive shared layers after it, and every shared layer has a position in
its group. A shared layer before the first full layer has no top-k to reuse and is an error.

Pipeline stages see only the layers ``start .. end - 1`` of the model:
:meth:`LayerPattern.stage` cuts the model's pattern to a stage and remembers ``start``, and
:meth:`LayerPattern.local_index` is the one conversion from a model layer id to a local index
(with a range check). Everything else here works in local indices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import _checks

__all__ = ["LayerPattern", "layer_pattern"]

_FULL_WORDS = {"f": True, "full": True, "s": False, "shared": False}


class LayerPattern:
    """Full/shared flags of consecutive layers, with their groups.

    Parameters
    ----------
    full : sequence of bool
        ``full[i]`` is True when local layer ``i`` runs its own indexer.
    first_layer : int
        Model layer id of local layer 0 (non-zero for a pipeline stage), default 0.

    Raises
    ------
    ValueError
        Empty pattern, or a shared layer before the first full layer.
    """

    def __init__(self, full: Sequence[bool], *, first_layer: int = 0):
        flags = tuple(bool(f) for f in full)
        if not flags:
            raise ValueError("a layer pattern needs at least one layer")
        first_layer = _checks.integer("first_layer", first_layer, 0)
        if not flags[0]:
            k = flags.index(True) if True in flags else len(flags)
            what = ("every layer is shared" if k == len(flags)
                    else f"the first full layer is {first_layer + k}")
            raise ValueError(
                f"layer {first_layer} is shared but no full layer precedes it ({what}); a shared "
                f"layer reuses the top-k of the nearest full layer before it. For a pipeline "
                f"stage that starts with a shared layer, mark its first layer full (that stage "
                f"must compute its own top-k)")
        self.full: tuple[bool, ...] = flags
        self.first_layer = first_layer
        groups: dict[int, tuple[int, ...]] = {}
        anchor: list[int] = []
        position: list[int] = []
        cur: list[int] = []
        a = 0
        for i, f in enumerate(flags):
            if f:
                if i:
                    groups[a] = tuple(cur)
                a, cur = i, []
                anchor.append(i)
                position.append(-1)
            else:
                anchor.append(a)
                position.append(len(cur))
                cur.append(i)
        groups[a] = tuple(cur)
        self._groups = groups
        self._anchor = tuple(anchor)
        self._position = tuple(position)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_string(cls, pattern: str, *, first_layer: int = 0) -> LayerPattern:
        """One character per layer: ``F`` (full) or ``S`` (shared), case-insensitive."""
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be a str, got {type(pattern).__name__}")
        flags = []
        for i, c in enumerate(pattern):
            if c.lower() not in ("f", "s"):
                raise ValueError(f"pattern character {i} is {c!r}; use 'F' (full) or 'S' "
                                 f"(shared), one per layer")
            flags.append(c.lower() == "f")
        return cls(flags, first_layer=first_layer)

    @classmethod
    def from_freq(cls, n_layers: int, freq: int, offset: int | None = None) -> LayerPattern:
        """SGLang's rule for ``index_topk_freq`` / ``index_skip_topk_offset``.

        Layer ``i`` is shared when ``max(i - 1, 0) % freq != 0`` (no offset), or when
        ``max(i - offset + 1, 0) % freq != 0`` (with an offset). ``freq = 1`` makes every layer
        full. GLM-5.2 (78 layers, freq 4, offset 3): full layers 0, 1, 2, 6, 10, ..., 74 and 57
        shared layers. Without an offset, freq 4 gives full layers 0, 1, 5, 9, ..., 77.

        Parameters
        ----------
        n_layers : int >= 1
        freq : int >= 1
        offset : int >= 0, optional
        """
        n_layers = _checks.integer("n_layers", n_layers, 1)
        freq = _checks.integer("freq", freq, 1)
        shift = 1 if offset is None else _checks.integer("offset", offset, 0) - 1
        return cls([max(i - shift, 0) % freq == 0 for i in range(n_layers)])

    @classmethod
    def from_list(cls, items: Sequence, *, first_layer: int = 0) -> LayerPattern:
        """One entry per layer: bool (True = full) or ``"full"``/``"shared"``/``"F"``/``"S"``."""
        if isinstance(items, str):
            raise TypeError("from_list takes a sequence of per-layer entries; use from_string "
                            "for a pattern string")
        flags = []
        for i, x in enumerate(items):
            if isinstance(x, str) and x.lower() in _FULL_WORDS:
                flags.append(_FULL_WORDS[x.lower()])
            elif isinstance(x, (bool, np.bool_)):
                flags.append(bool(x))
            else:
                raise ValueError(f"pattern entry {i} is {x!r}; use True/False or 'full'/'shared'")
        return cls(flags, first_layer=first_layer)

    # ------------------------------------------------------------------ queries
    @property
    def n_layers(self) -> int:
        return len(self.full)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Local indices of the full layers."""
        return tuple(i for i, f in enumerate(self.full) if f)

    @property
    def shared_layers(self) -> tuple[int, ...]:
        """Local indices of the shared layers."""
        return tuple(i for i, f in enumerate(self.full) if not f)

    @property
    def groups(self) -> dict[int, tuple[int, ...]]:
        """Full layer -> the consecutive shared layers after it (possibly empty), local indices."""
        return dict(self._groups)

    @property
    def max_group_size(self) -> int:
        return max(len(g) for g in self._groups.values())

    @property
    def shared_fraction(self) -> float:
        """Shared layers over all layers: the share of the IO a shared-layer prefetch can hide."""
        return len(self.shared_layers) / self.n_layers

    def _check(self, layer: int) -> int:
        if isinstance(layer, bool) or not hasattr(layer, "__index__"):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        layer = int(layer)
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"local layer {layer} is outside the pattern's {self.n_layers} "
                             f"layers (0 .. {self.n_layers - 1})")
        return layer

    def is_full(self, layer: int) -> bool:
        return self.full[self._check(layer)]

    def anchor(self, layer: int) -> int:
        """The full layer whose top-k ``layer`` uses (itself for a full layer)."""
        return self._anchor[self._check(layer)]

    def position(self, layer: int) -> int:
        """Position of a shared layer in its group (0 = first after the full layer); -1 for full."""
        return self._position[self._check(layer)]

    # ------------------------------------------------------------------ stages
    def stage(self, start: int, end: int) -> LayerPattern:
        """The pattern of a pipeline stage that holds model layers ``start .. end - 1``.

        The result keeps ``first_layer = start`` so :meth:`local_index` converts model layer
        ids. A stage whose first layer is shared is an error (it has no full layer to reuse).
        """
        if self.first_layer:
            raise ValueError("stage() cuts the model's pattern; this pattern is already a stage")
        start = _checks.integer("start", start, 0)
        end = _checks.integer("end", end, start + 1)
        if end > self.n_layers:
            raise ValueError(f"stage layers {start} .. {end - 1} exceed the model's "
                             f"{self.n_layers} layers")
        return LayerPattern(self.full[start:end], first_layer=start)

    def local_index(self, layer: int) -> int:
        """Model layer id -> local index: ``layer - first_layer``, range-checked.

        Raises
        ------
        ValueError
            The layer is not one of this pattern's (stage's) layers.
        """
        if isinstance(layer, bool) or not hasattr(layer, "__index__"):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        layer = int(layer)
        local = layer - self.first_layer
        if not 0 <= local < self.n_layers:
            raise ValueError(f"layer {layer} is outside this pattern's layers "
                             f"{self.first_layer} .. {self.first_layer + self.n_layers - 1}")
        return local

    def check_length(self, n_layers: int, what: str = "the model") -> None:
        """Raise ``ValueError`` unless the pattern has ``n_layers`` layers."""
        if self.n_layers != n_layers:
            raise ValueError(f"the layer pattern has {self.n_layers} layers but {what} has "
                             f"{n_layers}")

    # ------------------------------------------------------------------ misc
    def __str__(self) -> str:
        return "".join("F" if f else "S" for f in self.full)

    def __repr__(self) -> str:
        first = f", first_layer={self.first_layer}" if self.first_layer else ""
        return f"LayerPattern('{self}'{first})"

    def __eq__(self, other) -> bool:
        return (isinstance(other, LayerPattern) and self.full == other.full
                and self.first_layer == other.first_layer)

    def __hash__(self) -> int:
        return hash((self.full, self.first_layer))


def layer_pattern(spec, n_layers: int | None = None) -> LayerPattern:
    """Build a :class:`LayerPattern` from any accepted form and check its length.

    Parameters
    ----------
    spec : LayerPattern, str, tuple or list
        A pattern; a string such as ``"FFFSSS"``; a tuple ``(layers, freq)`` or
        ``(layers, freq, offset)`` (SGLang's rule, :meth:`LayerPattern.from_freq`); or a list
        with one bool / ``"full"`` / ``"shared"`` entry per layer.
    n_layers : int, optional
        The model's layer count; a pattern of another length is a ``ValueError``.
    """
    if isinstance(spec, LayerPattern):
        pat = spec
    elif isinstance(spec, str):
        pat = LayerPattern.from_string(spec)
    elif isinstance(spec, tuple) and 2 <= len(spec) <= 3 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in spec if v is not None):
        pat = LayerPattern.from_freq(*spec)
    elif isinstance(spec, (list, tuple)):
        pat = LayerPattern.from_list(spec)
    else:
        raise TypeError(f"cannot build a layer pattern from {type(spec).__name__}; pass a "
                        f"string, (layers, freq[, offset]), a per-layer list or a LayerPattern")
    if n_layers is not None:
        pat.check_length(n_layers)
    return pat

