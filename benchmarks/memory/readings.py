"""One memory-benchmark launch read into its record: the mode arms' figures (``worker.py``'s ``result.json``) and a
ladder climb's (``ladder.climb``'s answer). Byte figures are kept in bytes and, for the summary, in MB."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.sharding_engines.common import reading_of

from .ladder import largest

__all__ = ["CHECKPOINT_KEYS", "checkpoint_reading", "ladder_reading", "mode_reading"]

MB = 1e6
CHECKPOINT_KEYS = ("s", "growth_mb", "growth_ratio", "disk_mb")


def _max_mb(ranks: list[dict[str, Any]], key: Any) -> float:
    return max(key(r) for r in ranks) / MB


def mode_reading(result: Mapping[str, Any]) -> dict[str, Any]:
    """The sharding benchmark's reading (optimizer state, step, payloads, RSS) plus, per rank, the parameters,
    gradients and optimizer state it holds (model state), the activations' peak, and the checkpoint saves."""
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    out = reading_of(result)
    model_state = [r["param_bytes"] + r["grad_bytes_local"] + r["state_bytes"] for r in ranks]
    out.update(
        param_mb_max=_max_mb(ranks, lambda r: r["param_bytes"]),
        grad_local_mb_max=_max_mb(ranks, lambda r: r["grad_bytes_local"]),
        model_state_bytes_ranks=model_state,
        model_state_mb_max=max(model_state) / MB,
        activation_mb_max=_max_mb(ranks, lambda r: r["activation_bytes"]),
    )
    out.update(checkpoint_reading(result.get("checkpoint") or {}, ranks))
    return out


def checkpoint_reading(checkpoint: Mapping[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind (sharded, full): rank 0's save time, its resident-set growth during the save, that growth over
    1/N of the model (parameters + optimizer state over every rank: what a checkpoint holds), and the bytes on disk."""
    if not checkpoint:
        return {}
    if "unavailable" in checkpoint:
        return {"ckpt_unavailable": checkpoint["unavailable"]}
    model = sum(r["param_bytes"] + r["state_bytes"] for r in ranks)
    out: dict[str, Any] = {"ckpt_model_mb": model / MB}
    for save in checkpoint.get("saves", []):
        rank0 = min(save["ranks"], key=lambda r: r["rank"])
        kind, growth = save["kind"], rank0["growth_bytes"]
        errors = [r["error"] for r in save["ranks"] if r.get("error")]
        if errors:
            out[f"ckpt_{kind}_error"] = errors[0]
            continue
        out[f"ckpt_{kind}_s"] = rank0["seconds"]
        out[f"ckpt_{kind}_growth_mb"] = None if growth is None else growth / MB
        out[f"ckpt_{kind}_growth_ratio"] = None if growth is None else growth / (model / len(ranks))
        out[f"ckpt_{kind}_disk_mb"] = None if save.get("disk_bytes") is None else save["disk_bytes"] / MB
    return out


def ladder_reading(climb: Mapping[str, Any]) -> dict[str, Any]:
    """A climb's record: the largest rung every rank finished (its parameters, shape and peaks) and why it stopped."""
    top = largest(climb["finished"])
    return {
        "largest_parameters": top["parameters"] if top else None,
        "largest_mparams": top["parameters"] / 1e6 if top else None,
        "largest_rung": top["rung"] if top else None,
        "largest_shape": f"d_model {top['d_model']}, {top['n_layer']} layers" if top else "-",
        "largest_peak_rss_mb": max(top["peak_rss_mb_ranks"]) if top else None,
        "rungs_finished": len(climb["finished"]),
        "stopped": climb["outcome"],
        "stop_error": climb.get("error", ""),
        "cgroup_peak_mb": [b / 2**20 for b in climb["cgroup_peak_bytes"]],
        "climb_s": climb["seconds"],
    }
