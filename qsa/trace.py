"""Selection traces: the token selections of real (or synthetic) forward passes, stored so the
workbench can replay them (docs/traces.md).

Why: how fast sparse GQA runs, and whether rows should share K/V tiles, depends on how the
rows' selections overlap, which synthetic inputs only approximate. A trace carries exactly
what the indexer chose, per layer and row; replaying it keeps K/V random (the selections, not
the values, decide the speed).

The file is safetensors (the field's tensor format) with its metadata as JSON strings:
`format` "qsa-selection-trace", `version` "1", `preset` (its name), `topk_groups`, `layers`
(JSON list of layer ids: the preset's QSA layers, or `num_layers` for the MTP draft layer) and
an optional `source`. Tensors, all int32 unless said:
  context_lens [requests]      tokens of each request, this pass's included
  request      [rows]          each row's request, non-decreasing (rows grouped by request)
  position     [rows]          each row's position: a request's rows are its last tokens
  visible      [rows]          min((position + 1) // 4, context // 4): the groups it could pick
  groups       [layers, rows, topk]  the selected groups, ascending, -1 padded, exactly
                               min(topk, visible) of them
  q_index      [layers, rows, index_heads, index_dim] float32, optional: the index queries
The reader refuses anything else with one line naming the problem (`TraceError`).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qsa import overlap as ov
from qsa.cases import CaseSpec, make_batch, random_selection, selection_generator
from qsa.paging import PagedBatch
from qsa.presets import ModelPreset, ShapeError, get_preset
from qsa.reference.topk import expand_reference

FORMAT = "qsa-selection-trace"
VERSION = "1"
REQUIRED = ("context_lens", "request", "position", "visible", "groups")
OPTIONAL = ("q_index",)
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the JSON header


class TraceError(ValueError):
    """A trace file that can not be replayed; the message names the file and the problem."""


@dataclass(frozen=True)
class SelectionTrace:
    preset: ModelPreset
    layers: tuple[int, ...]
    context_lens: torch.Tensor
    request: torch.Tensor
    position: torch.Tensor
    visible: torch.Tensor
    groups: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    source: str = ""

    @property
    def rows(self) -> int:
        return int(self.request.numel())

    @property
    def rows_per_request(self) -> tuple[int, ...]:
        return tuple(torch.bincount(self.request.long(),
                                    minlength=self.context_lens.numel()).tolist())

    def layer_at(self, layer: int | None) -> int:
        """Index into `groups` of a layer id (None: the first layer of the trace)."""
        if layer is None:
            return 0
        if layer not in self.layers:
            raise TraceError(f"trace: no layer {layer}; it holds layers {list(self.layers)}")
        return self.layers.index(layer)

    def token_ids(self, layer: int | None = None, device: str | torch.device = "cpu"
                  ) -> torch.Tensor:
        """The expanded token ids of one layer's rows (spec section 2 step 5)."""
        g = self.groups[self.layer_at(layer)].to(device)
        counts = (g >= 0).sum(1).to(torch.int32)
        return expand_reference(g, counts, self.position.to(device), self.preset.expand_width)

    def overlap(self, layer: int | None = None, per: int | None = None) -> ov.Overlap:
        """What one layer's selections measure (`qsa.overlap`), union at `per` rows (default:
        the rows per request of a verify step)."""
        return ov.measure(self.token_ids(layer), self.batch(), per or self.preset.rows_per_verify)

    def batch(self) -> PagedBatch:
        """The trace's requests and rows as a batch (pages in order: a measure of its
        selections needs no page table)."""
        spec = CaseSpec(self.preset, tuple(self.context_lens.tolist()), self.rows_per_request,
                        shuffle_pages=False, spare_blocks=0)
        return make_batch(spec, torch.Generator(), "cpu")


def write_trace(path: str | Path, trace: SelectionTrace) -> Path:
    """Store a trace (module docstring); refuses one the reader would refuse."""
    from safetensors.torch import save_file

    _validate(trace, str(path))
    tensors = {"context_lens": trace.context_lens, "request": trace.request,
               "position": trace.position, "visible": trace.visible, "groups": trace.groups,
               **trace.extras}
    meta = {"format": FORMAT, "version": VERSION, "preset": trace.preset.name,
            "topk_groups": str(trace.preset.topk_groups), "layers": json.dumps(list(trace.layers)),
            "source": trace.source}
    path = Path(path)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


def _header(data: bytes, where: str) -> dict:
    if len(data) < 8:
        raise TraceError(f"{where}: {len(data)} bytes, not a safetensors file (truncated?)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(MAX_HEADER_BYTES, len(data) - 8):
        raise TraceError(f"{where}: header of {n} bytes in a file of {len(data)}: truncated or "
                         "not a safetensors file")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{where}: the safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise TraceError(f"{where}: the safetensors header is not a JSON object")
    return header


def read_trace(path: str | Path, preset: ModelPreset | str | None = None) -> SelectionTrace:
    """Read and validate a trace; `preset`: the one it must be for (default: the one it
    names). The whole file is read into memory first (no mapping that could change under
    the reader)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    where = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TraceError(f"{where}: can not read it ({e.strerror or e})") from None
    meta = _header(data, where).get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TraceError(f"{where}: not a selection trace (metadata format must be {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise TraceError(f"{where}: trace version {meta.get('version')!r}; this reader takes "
                         f"{VERSION!r}")
    try:
        named = get_preset(meta.get("preset", ""))
    except (ShapeError, KeyError, ValueError) as e:
        raise TraceError(f"{where}: preset: {e}") from None
    if preset is not None:
        want = get_preset(preset) if isinstance(preset, str) else preset
        if want.name != named.name:
            raise TraceError(f"{where}: a trace of preset {named.name!r}, not {want.name!r}")
        named = want
    if meta.get("topk_groups") != str(named.topk_groups):
        raise TraceError(f"{where}: selected with top-{meta.get('topk_groups')} groups; preset "
                         f"{named.name!r} selects {named.topk_groups}")
    try:
        layers = json.loads(meta.get("layers", ""))
    except json.JSONDecodeError:
        layers = None
    if not (isinstance(layers, list) and layers and all(type(x) is int for x in layers)):
        raise TraceError(f"{where}: metadata layers must be a JSON list of layer ids, got "
                         f"{meta.get('layers')!r}")
    try:
        tensors = load(data)
    except SafetensorError as e:
        raise TraceError(f"{where}: not a valid safetensors file ({e})") from None
    missing = [k for k in REQUIRED if k not in tensors]
    if missing:
        raise TraceError(f"{where}: missing tensors {missing}")
    unknown = sorted(set(tensors) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise TraceError(f"{where}: unknown tensors {unknown}")
    trace = SelectionTrace(named, tuple(layers), *(tensors[k] for k in REQUIRED),
                           extras={k: tensors[k] for k in OPTIONAL if k in tensors},
                           source=str(meta.get("source", "")))
    _validate(trace, where)
    return trace


def _validate(t: SelectionTrace, where: str) -> None:
    """Every rule of the module docstring, the first broken one named."""
    p = t.preset

    def fail(msg: str) -> None:
        raise TraceError(f"{where}: {msg}")

    for name in REQUIRED:
        x = getattr(t, name)
        if x.dtype != torch.int32:
            fail(f"{name} must be int32, got {x.dtype}")
    allowed = (*p.qsa_layers, p.num_layers)
    if len(set(t.layers)) != len(t.layers) or not set(t.layers) <= set(allowed):
        fail(f"layers {list(t.layers)}: each once, from the preset's QSA layers "
             f"{list(p.qsa_layers)} or {p.num_layers} (the draft layer)")
    if t.context_lens.dim() != 1 or t.context_lens.numel() == 0:
        fail(f"context_lens must be [requests] with at least one, got {tuple(t.context_lens.shape)}")
    rows = t.request.numel()
    for name in ("request", "position", "visible"):
        if tuple(getattr(t, name).shape) != (rows,):
            fail(f"{name} must be [rows] = [{rows}], got {tuple(getattr(t, name).shape)}")
    if rows == 0:
        fail("no rows")
    want = (len(t.layers), rows, p.topk_groups)
    if tuple(t.groups.shape) != want:
        fail(f"groups must be [layers, rows, topk] = {list(want)}, got {list(t.groups.shape)}")
    ctx = t.context_lens.long()
    if bool((ctx < 1).any()) or bool((ctx > p.max_context).any()):
        fail(f"context_lens outside 1..{p.max_context}")
    req = t.request.long()
    if bool((req < 0).any()) or bool((req >= ctx.numel()).any()):
        fail(f"request ids outside 0..{ctx.numel() - 1}")
    if rows > 1 and bool((req[1:] < req[:-1]).any()):
        fail("rows are not grouped by request (request ids must not decrease)")
    pos = t.position.long()
    last = torch.cumsum(torch.bincount(req, minlength=ctx.numel()), 0)
    local = torch.arange(rows) - (last - torch.bincount(req, minlength=ctx.numel()))[req]
    expect = ctx[req] - torch.bincount(req, minlength=ctx.numel())[req] + local
    bad = torch.nonzero(pos != expect).flatten()
    if bad.numel():
        r = int(bad[0])
        fail(f"row {r}: position {int(pos[r])}; a request's rows are its last tokens, so "
             f"{int(expect[r])} (context {int(ctx[req[r]])})")
    vis = torch.minimum((pos + 1) // 4, ctx[req] // 4)
    bad = torch.nonzero(t.visible.long() != vis).flatten()
    if bad.numel():
        r = int(bad[0])
        fail(f"row {r}: visible {int(t.visible[r])} does not match its position (expected "
             f"{int(vis[r])})")
    g = t.groups.long()
    valid = g >= 0
    out = (g < -1) | ((g >= vis[None, :, None]) & valid)
    if bool(out.any()):
        li, r, _ = (int(x) for x in torch.nonzero(out)[0])
        fail(f"layer {t.layers[li]} row {r}: a group id outside -1..{int(vis[r]) - 1}")
    count = valid.sum(-1)
    need = torch.clamp(vis, max=p.topk_groups)[None, :]
    if bool((count != need).any()):
        li, r = (int(x) for x in torch.nonzero(count != need)[0])
        fail(f"layer {t.layers[li]} row {r}: {int(count[li, r])} groups selected, expected "
             f"min(top-k, visible) = {int(need[0, r])}")
    k = torch.arange(p.topk_groups)
    if bool((valid & (k[None, None, :] >= need[..., None])).any()):
        fail("groups: -1 padding must follow the selected groups")
    if p.topk_groups > 1 and bool(((g[..., 1:] <= g[..., :-1]) & valid[..., 1:]).any()):
        fail("groups: each row's groups must be ascending and distinct")
    q = t.extras.get("q_index")
    if q is not None:
        shape = (len(t.layers), rows, p.index_heads, p.index_dim)
        if q.dtype != torch.float32 or tuple(q.shape) != shape:
            fail(f"q_index must be float32 {list(shape)}, got {q.dtype} {list(q.shape)}")
        if not bool(torch.isfinite(q).all()):
            fail("q_index holds non-finite values")


def synth_trace(preset: ModelPreset, batch: int, context: int, rows: int, overlap: float,
                layers: int = 1, seed: int = 0) -> SelectionTrace:
    """A synthetic trace in the same format: `batch` requests of `context` tokens whose last
    `rows` rows select random groups overlapping by `overlap` (calibrated per layer, as
    `qsa bench --selection random --overlap` does). For tests and demos."""
    if not 1 <= layers <= len(preset.qsa_layers):
        raise TraceError(f"layers: {layers} is outside 1..{len(preset.qsa_layers)}")
    spec = CaseSpec.decode(preset, batch, context, rows, seed=seed)
    b = make_batch(spec, torch.Generator().manual_seed(seed), "cpu")
    gen = selection_generator(seed)
    vis = torch.minimum((b.positions.long() + 1) // 4, b.context_lens.long()[b.row_request] // 4)
    per_layer = []
    for _ in range(layers):
        ids, _ = random_selection(b, preset, gen, overlap)
        g = torch.where((ids >= 0) & (ids < 4 * vis[:, None]), ids // 4, -1)[:, ::4]
        g = torch.where(g >= 0, g, torch.iinfo(torch.int32).max).sort(dim=1).values
        g = torch.where(g == torch.iinfo(torch.int32).max, -1, g)
        out = torch.full((b.num_rows, preset.topk_groups), -1, dtype=torch.int32)
        n = min(g.shape[1], preset.topk_groups)
        out[:, :n] = g[:, :n].to(torch.int32)
        per_layer.append(out)
    return SelectionTrace(preset, tuple(preset.qsa_layers[:layers]), b.context_lens.clone(),
                          b.row_request.to(torch.int32), b.positions.clone(),
                          vis.to(torch.int32), torch.stack(per_layer),
                          source=f"synthetic: overlap {overlap:g}, seed {seed}")


def describe(trace: SelectionTrace) -> dict[str, object]:
    """What `qsa trace check` prints: shape, layers and each layer's measured overlap."""
    per = [trace.overlap(layer) for layer in trace.layers]
    jac = [o.jaccard for o in per if not math.isnan(o.jaccard)]
    return {"preset": trace.preset.name, "requests": int(trace.context_lens.numel()),
            "rows": trace.rows, "layers": list(trace.layers),
            "max_context": int(trace.context_lens.max()),
            "overlap_measured": sum(jac) / len(jac) if jac else math.nan,
            "overlap_by_layer": [o.jaccard for o in per],
            "union_ratio": per[0].union_ratio, "union_rows": per[0].per,
            "source": trace.source}
