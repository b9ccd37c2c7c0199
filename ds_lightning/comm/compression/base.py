"""The ``Compression`` protocol: what one gradient-compression method provides to each part that uses it.

A method is one subclass in one module, registered by name (:mod:`~ds_lightning.comm.compression.registry`). Its
users ask it, never its name:

* ``ds_mirrored`` (through :class:`~ds_lightning.comm.compression.compressor.GradientCompressor`): its DDP comm hook
  and the hook's state (:meth:`Compression.ddp_hook`), and that state as a checkpointable dict
  (:meth:`Compression.state_dict`, pytorch issue 75666);
* the two-level all-reduce: its inter-host stage (:meth:`Compression.inter_host`);
* ``gradient_compression="auto"``: its bytes model (:meth:`Compression.sent_bytes`,
  :meth:`Compression.comm_seconds`) and its compute probe (:meth:`Compression.compute_probe`);
* ``ds_parameter_server``'s pushes: :meth:`Compression.encode`, :meth:`Compression.decode` and
  :meth:`Compression.payload_shapes`.

A method that does not serve a use leaves that use out of :attr:`Compression.uses`; :meth:`Compression.require`
then refuses it with an error naming the value, why, and the methods that do serve it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor

from ds_lightning import _validation as check
from ds_lightning.comm.wire import WireLog

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ds_lightning.comm.auto.model import LinkFigures, Workload
    from ds_lightning.comm.hierarchical import HostGroups

__all__ = ["USES", "Compression", "CompressionOptions", "InterHostStage", "Use", "gradient_numel"]

Use = Literal["all_reduce", "two_level", "push"]
USES: dict[str, str] = {
    "all_reduce": "ds_mirrored's gradient all-reduce",
    "two_level": "the two-level all-reduce that hierarchical=True asks for",
    "push": "ds_parameter_server's gradient pushes",
}
_OTHER_FIX: dict[str, str] = {"two_level": ", or set hierarchical=False"}
Hook = Callable[[Any, "dist.GradBucket"], "torch.futures.Future[torch.Tensor]"]
InterHostStage = Callable[["dist.GradBucket", "HostGroups"], None]
"""On a host's leader: turn the host's gradient sum in the bucket into the mean over every rank of the run."""


@dataclass(frozen=True)
class CompressionOptions:
    """Every method's options, flat as the strategies take them; each method reads its own.

    Attributes:
        powersgd_rank: PowerSGD's approximation rank.
        powersgd_start_iter: plain all-reduce steps before PowerSGD starts.
        powersgd_min_compression_rate: matrices that would shrink less than this travel uncompressed.
        seed: seed of PowerSGD's initial projections, identical on every rank.
        topk_ratio: fraction of entries top-k sends, in ``(0, 1]``.
        error_feedback: top-k keeps what it did not send and adds it to the next gradient.
        auto_interval: under ``"auto"``, gradient synchronisations between link probes.

    Raises:
        ValueError: for an option out of its range, naming the value and the fix.

    """

    powersgd_rank: int = 2
    powersgd_start_iter: int = 10
    powersgd_min_compression_rate: float = 2.0
    seed: int = 0
    topk_ratio: float = 0.01
    error_feedback: bool = True
    auto_interval: int = 500

    def __post_init__(self) -> None:
        check.integer("powersgd_rank", self.powersgd_rank, 1, "powersgd_rank=2")
        check.integer("powersgd_start_iter", self.powersgd_start_iter, 0, "powersgd_start_iter=10")
        check.number("powersgd_min_compression_rate", self.powersgd_min_compression_rate, "2.0", above=0)
        check.integer("auto_interval", self.auto_interval, 1, "auto_interval=500", "steps between link probes")
        ratio = self.topk_ratio
        if not check.is_number(ratio) or not 0 < ratio <= 1:  # NaN fails both comparisons
            raise ValueError(f"topk_ratio={ratio!r} must be a number in (0, 1], e.g. topk_ratio=0.01.")
        check.flag("error_feedback", self.error_feedback)


def gradient_numel(shapes: Sequence[tuple[int, ...]]) -> int:
    """Numbers in one full gradient of parameters of ``shapes``."""
    return sum(math.prod(shape) for shape in shapes)


class Compression:
    """One compression method, configured by :class:`CompressionOptions`; one instance serves one use at a time.

    Subclasses set the class attributes and implement the methods of the uses they list in :attr:`uses`.

    Attributes:
        name: the value of ``gradient_compression`` that selects it.
        uses: the uses it serves (``"all_reduce"``, ``"two_level"``, ``"push"``).
        unsupported: why a use is not served, per use left out of :attr:`uses` (the error shows it).
        builtin: DDP's own all-reduce does exactly what its hook does, so no hook is needed unless one must wrap it.
        lossless: gradients arrive exactly; ``auto``'s baseline, which a compression must beat by a margin.
        auto_candidate: ``auto`` may choose it.
        checkpointed: its all-reduce state changes the result and is saved in checkpoints (per rank).
        wire_dtype: the dtype it all-reduces in (``None``: the gradient's own).

    """

    name: ClassVar[str]
    uses: ClassVar[frozenset[str]] = frozenset()
    unsupported: ClassVar[dict[str, str]] = {}
    builtin: ClassVar[bool] = False
    lossless: ClassVar[bool] = False
    auto_candidate: ClassVar[bool] = False
    checkpointed: ClassVar[bool] = False
    wire_dtype: ClassVar[torch.dtype | None] = None

    def __init__(self, options: CompressionOptions | None = None) -> None:
        self.options = options if options is not None else CompressionOptions()

    @classmethod
    def require(cls, use: str, option: str = "gradient_compression") -> None:
        """Refuse a use this method does not serve, naming the value, the reason and the methods that serve it.

        Raises:
            ValueError: if ``use`` is not in :attr:`uses`.

        """
        if use in cls.uses:
            return
        from ds_lightning.comm.compression.registry import names  # the registry imports this module

        reason = cls.unsupported.get(use)
        others = ", ".join(repr(n) for n in names(use))
        raise ValueError(
            f"{option}={cls.name!r} does not work with {USES[use]}{f' ({reason})' if reason else ''}: choose one of"
            f" {others}{_OTHER_FIX.get(use, '')}."
        )

    # --- ds_mirrored: the flat all-reduce -------------------------------------------------------------------------

    def ddp_hook(
        self, process_group: dist.ProcessGroup | None, model: DistributedDataParallel, wire: WireLog, warmup: bool
    ) -> tuple[Any, Hook]:
        """Build this rank's hook state for ``model`` and return ``(state, hook)`` for ``register_comm_hook``.

        Args:
            process_group: the group gradients are all-reduced over (``None``: the default group).
            model: the DDP model the hook serves.
            wire: the log every tensor handed to a collective is recorded in; the hook closes a step at the last
                bucket.
            warmup: run the method's own warm-up (``False`` when ``auto`` decides when it may run).

        """
        self.require("all_reduce")
        raise NotImplementedError

    def registered(self) -> None:
        """Called on every rank once the hook is registered (a method may run collectives here)."""

    def chosen(self) -> None:
        """Called when ``auto`` switches to this method from another one."""

    @property
    def warmup_steps(self) -> int:
        """Gradient synchronisations before the method may run (``auto`` does not choose it earlier)."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, as tensors and plain numbers (loadable with ``weights_only=True``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore :meth:`state_dict`'s output, moving tensors to ``device``."""

    # --- the two-level all-reduce ---------------------------------------------------------------------------------

    def inter_host(self, hosts: HostGroups, model: DistributedDataParallel, wire: WireLog) -> InterHostStage:
        """The leaders' stage of the two-level all-reduce: a cast of the host sums to :attr:`wire_dtype`."""
        self.require("two_level")
        from ds_lightning.comm.hierarchical import CastStage  # hierarchical's hook runs the stage

        return CastStage(hosts.leaders, wire, self.wire_dtype)

    # --- auto: the bytes model and the compute probe ---------------------------------------------------------------

    def sent_bytes(self, shapes: Sequence[tuple[int, ...]]) -> float:
        """Bytes one step sends for float32 parameters of ``shapes``: the gradient, at :attr:`wire_dtype`'s width."""
        width = torch.empty(0, dtype=self.wire_dtype or torch.float32).element_size()
        return float(gradient_numel(shapes) * width)

    @classmethod
    def comm_seconds(cls, link: LinkFigures, work: Workload) -> float:
        """Predicted communication and compression compute of one step.

        One all-reduce per bucket, on the link's path for :attr:`wire_dtype`, plus the probed compute.
        """
        path = link.float32 if cls.wire_dtype in (None, torch.float32) else link.float16
        return path.seconds(work.sent_bytes[cls.name], link.world_size, work.buckets) + link.compress_s.get(
            cls.name, 0.0
        )

    def compute_probe(self, shapes: Sequence[tuple[int, ...]], device: torch.device) -> Callable[[], object] | None:
        """Work standing in for one step's compression compute on gradients of ``shapes`` (``None``: none)."""
        return None

    # --- ds_parameter_server: pushes ------------------------------------------------------------------------------

    def encode(self, flat_grad: Tensor) -> list[Tensor]:
        """Compress a flat 1-D gradient into the tensors one push sends."""
        self.require("push")
        raise NotImplementedError

    def decode(self, payload: Sequence[Tensor], numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rebuild the dense flat gradient of ``numel`` entries from :meth:`encode`'s tensors (no state needed)."""
        self.require("push")
        raise NotImplementedError

    def payload_shapes(
        self, numel: int, dtype: torch.dtype = torch.float32
    ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the tensors :meth:`encode` sends for a gradient of ``numel`` entries."""
        self.require("push")
        raise NotImplementedError

    @property
    def residual(self) -> Tensor | None:
        """What pushes have not sent yet and will add to the next gradient (``None``: nothing kept)."""
        return None

    def reset(self) -> None:
        """Drop what :attr:`residual` holds."""
