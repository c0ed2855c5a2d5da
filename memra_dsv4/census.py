"""The tensor census of a checkpoint or a preset: per-layer kinds and bytes, totals.

Contract
--------
* `census_of_preset(cfg, experts)` builds the census from the expected-tensor table alone (no
  data; works for flash / pro / flash-0731).  `census_of_checkpoint(ckpt)` builds it from an
  opened `Checkpoint`, whose open already ran the full validation, with each layer's expert
  format as detected from the stored tensors.
* A `Census` has one row per placement unit in pipeline order: embed, trunk layers, head group
  (head.weight + norm + hc_head), drafter stages.  Layer rows carry attention kind + compress
  ratio, routing (hash / learned), rope kind (plain / yarn), expert format, and bytes per owner
  group (attn, norm_hc, gate, shared, experts, drafter extras); every row carries its tensor
  count and total bytes.  Totals are sums of the rows, which are sums of the table.
* `python -m memra_dsv4 census DIR | --preset NAME [--experts mxfp4|nvfp4]
  [--drafter mtp|dspark|none]` prints the table, the grand total, the expert format and the
  drafter kind.  For a DIR the expert format comes from the tensors, so --experts/--drafter are
  refused there.  Argument and config errors print one line and exit 2; a failed checkpoint
  validation prints its whole report (every offender list) and exits 2.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .cli import ArgParser, UsageError
from .checkpoint import (Checkpoint, CheckpointError, expected_for_kinds, placement_units,
                         specs_by_unit, unit_label)
from .config import ConfigError, Dsv4Config, preset
from .synth import with_drafter
from .tensors import (EXPERT_FORMATS, G_ATTN, G_DRAFTER_EXTRA, G_EXPERTS, G_GATE, G_NORM_HC,
                      G_SHARED, TensorSpec)

__all__ = ["CensusRow", "Census", "census_of_preset", "census_of_checkpoint", "census_of_specs",
           "format_census", "main"]

# Column order of the per-group bytes in the printed table.
GROUP_COLUMNS = ((G_ATTN, "attn"), (G_NORM_HC, "norm_hc"), (G_GATE, "gate"),
                 (G_SHARED, "shared"), (G_EXPERTS, "experts"), (G_DRAFTER_EXTRA, "extra"))


@dataclass(frozen=True)
class CensusRow:
    unit: str                       # "embed", "head", trunk layer "0".., drafter "mtp.S"
    tensors: int
    group_bytes: dict[str, int] = field(default_factory=dict)
    attn: str | None = None         # sliding / csa / hca (layer rows only)
    ratio: int | None = None
    routing: str | None = None      # hash / learned
    rope: str | None = None         # plain / yarn
    experts: str | None = None      # mxfp4 / nvfp4

    @property
    def total(self) -> int:
        return sum(self.group_bytes.values())

    @property
    def is_drafter(self) -> bool:
        return self.unit.startswith("mtp.")


@dataclass(frozen=True)
class Census:
    config: Dsv4Config
    source: str
    rows: list[CensusRow]

    @property
    def total_bytes(self) -> int:
        return sum(r.total for r in self.rows)

    @property
    def n_tensors(self) -> int:
        return sum(r.tensors for r in self.rows)

    def row(self, unit: str | int) -> CensusRow:
        for r in self.rows:
            if r.unit == str(unit):
                return r
        raise KeyError(f"census has no row {unit!r}")

    @property
    def drafter_rows(self) -> list[CensusRow]:
        return [r for r in self.rows if r.is_drafter]

    @property
    def drafter_bytes(self) -> int:
        return sum(r.total for r in self.drafter_rows)

    def expert_format(self, drafter: bool = False) -> str:
        """Trunk (or drafter) expert format: 'mxfp4', 'nvfp4', or 'mixed(...)' per layer."""
        kinds = sorted({r.experts for r in self.rows if r.experts and r.is_drafter == drafter})
        return kinds[0] if len(kinds) == 1 else (f"mixed({'/'.join(kinds)})" if kinds else "-")


def census_of_specs(cfg: Dsv4Config, specs: list[TensorSpec], kinds: dict[int, str],
                    source: str) -> Census:
    by_unit = specs_by_unit(cfg, specs)
    rows = []
    for unit in placement_units(cfg):
        unit_specs = by_unit.get(unit, [])
        groups: dict[str, int] = {}
        for s in unit_specs:
            groups[s.group] = groups.get(s.group, 0) + s.nbytes
        if isinstance(unit, str):
            rows.append(CensusRow(unit, len(unit_specs), groups))
            continue
        rows.append(CensusRow(
            unit_label(cfg, unit), len(unit_specs), groups,
            attn=cfg.attn_kind(unit), ratio=cfg.compress_ratio(unit),
            routing="hash" if cfg.is_hash_layer(unit) else "learned",
            rope=cfg.rope_kind(unit), experts=kinds[unit]))
    return Census(cfg, source, rows)


def census_of_preset(cfg: Dsv4Config, experts: str = "mxfp4") -> Census:
    """Census from the table alone: trunk experts in `experts`, drafter experts MXFP4."""
    if experts not in EXPERT_FORMATS:
        raise ConfigError(f"experts={experts!r}: expected one of {', '.join(EXPERT_FORMATS)}")
    n = cfg.num_hidden_layers
    kinds = {l: experts if l < n else "mxfp4" for l in range(n + cfg.num_drafter_stages)}
    return census_of_specs(cfg, expected_for_kinds(cfg, kinds), kinds,
                           f"preset {cfg.name} (experts {experts})")


def census_of_checkpoint(ckpt: Checkpoint) -> Census:
    return census_of_specs(ckpt.config, ckpt.specs(), ckpt.expert_kinds, ckpt.source)


# ---------------------------------------------------------------------------------- printing
def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:,}" if isinstance(v, int) else str(v)


def format_census(c: Census) -> str:
    head = ["unit", "attn", "ratio", "route", "rope", "fmt", "tensors",
            *(label for _, label in GROUP_COLUMNS), "total"]
    table = []
    for r in c.rows:
        table.append([r.unit, _fmt(r.attn), _fmt(r.ratio), _fmt(r.routing), _fmt(r.rope),
                      _fmt(r.experts), _fmt(r.tensors),
                      *(_fmt(r.group_bytes.get(g)) for g, _ in GROUP_COLUMNS), _fmt(r.total)])
    sums = [sum(r.group_bytes.get(g, 0) for r in c.rows) for g, _ in GROUP_COLUMNS]
    table.append(["total", "", "", "", "", "", _fmt(c.n_tensors), *map(_fmt, sums),
                  _fmt(c.total_bytes)])
    widths = [max(len(row[i]) for row in [head, *table]) for i in range(len(head))]
    text_cols = 6   # left-aligned descriptive columns, then right-aligned numbers

    def line(row):
        return "  ".join(cell.ljust(w) if i < text_cols else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(row, widths))).rstrip()

    cfg = c.config
    out = [f"census of {c.source}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
           f"{cfg.n_routed_experts} experts", line(head), line(["-" * w for w in widths])]
    out += [line(row) for row in table[:-1]]
    out += [line(["-" * w for w in widths]), line(table[-1]), ""]
    drafter = c.drafter_rows
    out.append(f"grand total: {c.total_bytes:,} bytes ({c.total_bytes / 2**30:.2f} GiB) in "
               f"{c.n_tensors:,} tensors")
    out.append(f"expert format: trunk {c.expert_format()}"
               + (f", drafter {c.expert_format(drafter=True)}" if drafter else ""))
    out.append(f"drafter: {cfg.drafter_kind}"
               + (f", {len(drafter)} stage{'s' * (len(drafter) != 1)}, "
                  f"{sum(r.tensors for r in drafter):,} tensors, {c.drafter_bytes:,} bytes"
                  if drafter else ""))
    return "\n".join(out)


# ---------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m memra_dsv4 census",
                description="Print the tensor census of a checkpoint directory or a preset.")
    p.add_argument("dir", nargs="?", help="checkpoint directory (validated in full)")
    p.add_argument("--preset", help="tiny, small, flash-layers:N, flash, pro, flash-0731")
    p.add_argument("--experts", choices=EXPERT_FORMATS, default=None)
    p.add_argument("--drafter", choices=("mtp", "dspark", "none"), default=None)
    try:
        args = p.parse_args(argv)
        if (args.dir is None) == (args.preset is None):
            raise UsageError("give exactly one of DIR or --preset NAME")
        if args.dir is not None:
            if args.experts or args.drafter:
                raise UsageError("--experts/--drafter apply to --preset only; a checkpoint's "
                                "formats are read from its tensors and config")
            census = census_of_checkpoint(Checkpoint.open(args.dir))
        else:
            cfg = preset(args.preset)
            if args.drafter:
                cfg = with_drafter(cfg, args.drafter)
            census = census_of_preset(cfg, args.experts or "mxfp4")
    except (CheckpointError, UsageError, ConfigError, OSError) as e:
        # Printed whole, not cut to one line: a CheckpointError is the census report itself and
        # every offender list matters; the other messages are one line already.
        print(f"memra_dsv4 census: error: {e}", file=sys.stderr)
        return 2
    print(format_census(census))
    return 0
