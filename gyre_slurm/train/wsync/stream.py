"""One round of a streamed weight sync over a transfer group: the senders' side and the
receivers' side (point-to-point messages, one per piece and target, tagged with the
piece's index; see `plan` for what a piece is).

Senders (training ranks) go bucket by bucket: the pieces of the bucket they hold are
made contiguous in the wire dtype (a copy only where the shard's piece is a strided
view, e.g. q/k/v unpacked from Megatron's fused linear_qkv, or of another dtype), sent
to every target, and dropped once the bucket's sends are done. So a sender's memory
grows by at most its share of one bucket.

Receivers (rollout servers' workers) go bucket by bucket too: each tensor of the bucket
is allocated whole, every piece is received straight into its slice (through a
temporary only where the slice is strided: pieces split along dim 1), and the bucket's
tensors are handed to `load` (vLLM's `model.load_weights`, the embedded engine's
in-place copy) before the next bucket is received. A receiver's memory grows by one
bucket (plus what its loader keeps).

Faults. A target that dies mid-round fails its sends at once (connection reset): the
sender drops it and goes on for the others (`failed_targets` in the result). A target
that hangs makes a send wait until the group's timeout, after which gloo closes every
connection of the group: the round fails (`TransferTimeout`, naming the target), and
the coordinator retries in a new generation without it. A receiver whose round failed
holds half-loaded weights and must not serve until a round succeeds.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping

import torch

from gyre_slurm.train.wsync.plan import Piece, Plan

log = logging.getLogger(__name__)


class TransferTimeout(RuntimeError):
    """A send got no answer within the group's timeout: the group is closed."""

    def __init__(self, message: str, *, target: int, sent: int = 0):
        super().__init__(message)
        self.target, self.sent = target, sent


def peak_rss_reset() -> int:
    """Reset this process's peak resident memory (Linux: /proc/self/clear_refs 5) and
    return the current resident bytes (the baseline of `peak_rss_growth`)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # another OS: the peak is then the process's lifetime peak
    return _status_kb("VmRSS") * 1024


def peak_rss_growth(baseline: int) -> int:
    return max(0, _status_kb("VmHWM") * 1024 - baseline)


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+)", f.read(), re.M)
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return "Timed out" in text or "timeout" in text.lower()


def _local_piece(plan: Plan, piece: Piece, held: Mapping[str, tuple[torch.Tensor, int | None]],
                 device: torch.device) -> torch.Tensor:
    name = plan.params[piece.param][0]
    if name not in held:
        raise KeyError(f"this rank holds no piece of {name}, the plan says it sends one "
                       f"(TP {piece.tp}, PP {piece.pp})")
    t, dim = held[name]
    if callable(t):  # made when its bucket is sent (convert's lazy q/k/v copies)
        t = t()
    if dim != piece.dim:
        raise ValueError(f"{name}: held along dim {dim}, the plan cuts along {piece.dim}")
    if piece.dim is not None and t.shape[piece.dim] != piece.length:
        t = t.narrow(piece.dim, 0, piece.length)  # vocabulary padding stays here
    want = plan.piece_shape(piece)
    if tuple(t.shape) != want:
        raise ValueError(f"{name}: this rank's piece has shape {tuple(t.shape)}, the plan "
                         f"says {want}")
    return t.detach().to(device=device, dtype=plan.torch_dtype).contiguous()


def send(group, plan: Plan, held: Mapping[str, tuple[torch.Tensor, int | None]], *,
         targets: list[int], device: torch.device | None = None) -> dict:
    """Send this rank's pieces (`held`: {hf name: (piece, concat dim)}, as
    convert.megatron_shard_to_hf_pieces gives them) to the transfer ranks `targets`.
    Returns {"bytes", "seconds", "failed_targets": {rank: error}, "peak_growth_bytes"}."""
    device = device or torch.device("cpu")
    rank, live = group.rank, list(targets)
    failed: dict[int, str] = {}
    baseline = peak_rss_reset()
    sent, t0 = 0, time.perf_counter()
    for bucket in range(len(plan.buckets)):
        mine = [p for p in plan.bucket_pieces(bucket) if p.sender == rank]
        if not mine or not live:
            continue
        works, keep = [], []
        for piece in mine:
            t = _local_piece(plan, piece, held, device)
            keep.append(t)
            works += [(w, group.send(t, w, piece.tag)) for w in live]
            sent += t.numel() * t.element_size() * len(live)
        for target, work in works:
            try:
                group.wait(work)
            except RuntimeError as exc:
                if _is_timeout(exc):
                    raise TransferTimeout(f"transfer generation {group.generation}: a send "
                                          f"to rank {target} timed out ({exc})",
                                          target=target, sent=sent) from exc
                if target not in failed:
                    log.warning("transfer rank %d failed mid-round (%s): going on without "
                                "it", target, str(exc)[:200])
                failed.setdefault(target, str(exc)[:300])
        live = [w for w in live if w not in failed]
        del keep, works, t  # nothing of this bucket outlives it
    return {"bytes": sent, "seconds": time.perf_counter() - t0,
            "failed_targets": {str(k): v for k, v in failed.items()},
            "peak_growth_bytes": peak_rss_growth(baseline)}


def _receive_bucket(group, plan: Plan, bucket: int, device: torch.device):
    """One bucket's tensors, whole: [(hf name, tensor)], and the bytes received."""
    full: dict[int, torch.Tensor] = {}
    posts, got = [], 0
    for piece in plan.bucket_pieces(bucket):
        if piece.param not in full:
            full[piece.param] = torch.empty(plan.params[piece.param][1],
                                            dtype=plan.torch_dtype, device=device)
        dst = full[piece.param]
        if piece.dim is not None:
            dst = dst.narrow(piece.dim, piece.offset, piece.length)
        tmp = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype,
                                                          device=device)
        posts.append((group.recv(tmp, piece.sender, piece.tag), piece, dst, tmp))
    for work, piece, dst, tmp in posts:
        try:
            group.wait(work)
        except RuntimeError as exc:
            raise RuntimeError(f"transfer generation {group.generation}: receiving "
                               f"{plan.params[piece.param][0]} from rank {piece.sender} "
                               f"failed: {exc}") from exc
        if tmp is not dst:
            dst.copy_(tmp)
        got += tmp.numel() * tmp.element_size()
    return [(plan.params[i][0], t) for i, t in full.items()], got


def receive(group, plan: Plan, *, load: Callable[[list[tuple[str, torch.Tensor]]], object],
            device: torch.device | None = None) -> dict:
    """Receive every bucket of `plan` and hand each one's tensors to `load`. Returns
    {"bytes", "seconds", "buckets", "peak_growth_bytes"}; raises on any failed receive
    (the weights are then half loaded)."""
    device = device or torch.device("cpu")
    baseline = peak_rss_reset()
    got, t0 = 0, time.perf_counter()
    for bucket in range(len(plan.buckets)):
        tensors, n = _receive_bucket(group, plan, bucket, device)
        got += n
        load(tensors)
        del tensors  # nothing of this bucket outlives it (a loop variable would)
    return {"bytes": got, "seconds": time.perf_counter() - t0, "buckets": len(plan.buckets),
            "peak_growth_bytes": peak_rss_growth(baseline)}
