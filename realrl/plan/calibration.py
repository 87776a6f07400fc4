"""Per-MFC corrections to the cost model, fitted to short real runs on this machine.

The cost model prices an MFC from FLOPs, bytes and a per-layer kernel cost. On a CPU with a
small model that is a fraction of what a call takes: the master's request and the gather of
its results, packing, the decode loop's sampling and stopping in Python, the loss and the
optimizer's per-parameter kernels. `python -m realrl.apps.profile_plan` runs the experiment
for a few steps under *probe* allocations (every MFC on one worker; every MFC data-parallel
over all N workers; and, when every MFC can be split in two, every MFC ``d(N/2)t2``), reads each
MFC's measured seconds from ``metrics.jsonl``, and fits per MFC

    measured = scale x compute + offset + communication

where ``compute`` is `realrl.plan.costs.compute_seconds` and ``communication`` the analytic
tensor-parallel, pipeline, gradient and transfer terms of the same layout, and ``measured``
is at full speed: where a probe's call ran on more workers than the node has cores
(`Cluster.parallel_devices_per_node`), its seconds are scaled by its share of them
(`Cluster.solo_speed`), which the search applies again to each call by what runs beside it.
The tp = 1 probes give (scale, offset) from two points (one point: scale 1); each probe with
tensor parallelism adds an offset of its own for that tensor size (its collectives cost the
runtime more than the ring formula says), keeping the tp = 1 scale. A layout whose tensor size
no probe ran gets the tp = 1 fit. Where a probe runs different MFCs side by side on disjoint
workers, `realrl.plan.contention` fits how much they slow each other
(`Cluster.contention`, kept here as `Calibration.contention`).

The fit is cached per machine, thread count and workload (`calibration_path`), and
`allocation_mode=search` uses it whenever it exists (`realrl.plan.choose`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from realrl.api import environment
from realrl.plan.costs import Cluster, Layout, MFCWork, compute_seconds, mfc_seconds

# 2: `Calibration.contention`
FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class MFCCorrection:
    """``seconds = scale * compute + offset(tp) + communication`` for one MFC."""

    scale: float
    offset_s: float  # tp = 1
    tensor_offsets_s: tuple[tuple[int, float], ...] = ()  # (tp, offset) from tp > 1 probes

    def offset_for(self, tensor: int) -> float:
        return dict(self.tensor_offsets_s).get(tensor, self.offset_s)


@dataclasses.dataclass(frozen=True)
class Calibration:
    corrections: tuple[tuple[str, MFCCorrection], ...]  # MFC name -> correction
    source: str = ""  # where it was measured (the cache file), for the report
    contention: float = 0.0  # `Cluster.contention` the corrections were fitted with

    def correction(self, name: str) -> MFCCorrection | None:
        return dict(self.corrections).get(name)

    def to_json(self) -> dict:
        return {"version": FORMAT_VERSION, "contention": self.contention,
                "corrections": {name: {"scale": c.scale, "offset_s": c.offset_s,
                                       "tensor_offsets_s": {str(t): o
                                                            for t, o in c.tensor_offsets_s}}
                                for name, c in self.corrections}}

    @classmethod
    def from_json(cls, data: dict, source: str = "") -> Calibration:
        corrections = tuple(
            (name, MFCCorrection(entry["scale"], entry["offset_s"],
                                 tuple(sorted((int(t), o)
                                              for t, o in entry["tensor_offsets_s"].items()))))
            for name, entry in data["corrections"].items())
        return cls(corrections, source, data["contention"])


def communication_seconds(work: MFCWork, layout: Layout, cluster: Cluster) -> float:
    """Everything `mfc_seconds` counts besides compute: collectives and the master's transfers."""
    return mfc_seconds(work, layout, cluster) - compute_seconds(work, layout, cluster.device)


def corrected_seconds(work: MFCWork, layout: Layout, cluster: Cluster,
                      correction: MFCCorrection | None) -> float:
    """``scale x compute + offset + communication``: `mfc_seconds` with its compute term
    rescaled and the offset added (the model alone without a correction)."""
    seconds = mfc_seconds(work, layout, cluster)
    if correction is None:
        return seconds
    return (seconds + (correction.scale - 1) * compute_seconds(work, layout, cluster.device)
            + correction.offset_for(layout.strategy.tensor))


@dataclasses.dataclass(frozen=True)
class ProbeSample:
    """One MFC's median measured seconds under one probe layout."""

    layout: Layout
    measured_s: float


def fit_correction(work: MFCWork, cluster: Cluster, samples: list[ProbeSample]) -> MFCCorrection:
    """The correction for one MFC from its probe samples (see the module docstring).

    With two tp = 1 samples whose compute differs by at least 10%, a line through both
    (its scale kept at zero or above: a noisy pair cannot make more compute cost less);
    otherwise scale 1 and the mean residual."""
    points = []  # (compute, full-speed measured - communication, tp)
    for sample in samples:
        full_speed_s = sample.measured_s * cluster.solo_speed(sample.layout.mesh.ranks)
        points.append((compute_seconds(work, sample.layout, cluster.device),
                       full_speed_s - communication_seconds(work, sample.layout, cluster),
                       sample.layout.strategy.tensor))
    plain = [(x, y) for x, y, tensor in points if tensor == 1]
    if not plain:
        raise ValueError(f"MFC {work.name!r}: no probe without tensor parallelism")
    scale = 1.0
    if len(plain) >= 2:
        (x0, y0), (x1, y1) = min(plain), max(plain)
        if x1 > 1.1 * x0:
            scale = max(0.0, (y1 - y0) / (x1 - x0))
    offset = sum(y - scale * x for x, y in plain) / len(plain)
    tensor_offsets: dict[int, list[float]] = {}
    for x, y, tensor in points:
        if tensor > 1:
            tensor_offsets.setdefault(tensor, []).append(y - scale * x)
    return MFCCorrection(scale, offset, tuple(sorted(
        (tensor, sum(values) / len(values)) for tensor, values in tensor_offsets.items())))


def fit(works: dict[str, MFCWork], cluster: Cluster,
        samples: dict[str, list[ProbeSample]]) -> Calibration:
    return Calibration(tuple((name, fit_correction(works[name], cluster, samples[name]))
                             for name in works if samples.get(name)))


def calibration_path(works: dict[str, MFCWork], cluster: Cluster) -> Path:
    """Keyed by the graph's work (shapes, tokens, batch sizes), the cluster and the device
    (the CPU profile: machine and thread count), so another workload or machine profiles
    again."""
    key = repr((tuple(works.values()), cluster)).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return environment.cache_dir() / "plan" / f"calibration-{digest}.json"


def load_calibration(works: dict[str, MFCWork], cluster: Cluster) -> Calibration | None:
    path = calibration_path(works, cluster)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("version") != FORMAT_VERSION:
        return None
    return Calibration.from_json(data, str(path))


def save_calibration(works: dict[str, MFCWork], cluster: Cluster,
                     calibration: Calibration) -> Path:
    path = calibration_path(works, cluster)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration.to_json(), indent=1) + "\n")
    return path
