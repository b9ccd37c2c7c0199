"""``torch.compile`` under the strategies that cut a model into stages (``ds_pipeline``, ``ds_model_parallel``).

Lightning's documented way, ``trainer.fit(torch.compile(model))``, compiles the LightningModule's ``forward`` and
step methods (Lightning keeps the ``dynamo_ctx`` in ``model._compiler_ctx``). Under ``ds_model_parallel`` that
compiled ``training_step`` runs every stage, so nothing more is needed. Under ``ds_pipeline`` the stages run in
torch's pipeline schedule, outside ``training_step``: :func:`compile_stages` compiles each stage this process holds
with the same context, so that compiling the model compiles what runs. A compiled *submodule*
(``self.net = torch.compile(self.net)``) is one graph over the whole network, which neither strategy can cut into
stages: :func:`refuse_compiled_part` refuses it at set-up and names the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch._dynamo import OptimizedModule

__all__ = ["compile_stages", "refuse_compiled_part"]


#: What each strategy does with a compiled LightningModule, for the refusal's fix.
_WHOLE_MODEL = {
    "ds_pipeline": "ds_pipeline then compiles each stage",
    "ds_model_parallel": "its compiled training_step runs every stage",
}


def refuse_compiled_part(strategy: str, module: LightningModule, attribute: str) -> None:
    """Refuse a pipelined or split attribute that ``torch.compile`` wrapped, naming the fix.

    Args:
        strategy: ``"ds_pipeline"`` or ``"ds_model_parallel"``.
        module: the LightningModule.
        attribute: the attribute the strategy cuts into stages (``pipe_module``).

    Raises:
        ValueError: when ``module.<attribute>`` is a ``torch._dynamo.OptimizedModule``.

    """
    part = getattr(module, attribute, None)
    if isinstance(part, OptimizedModule):
        raise ValueError(
            f"{strategy} cuts `{type(module).__name__}.{attribute}` into stages, but it is a torch.compile'd module"
            f" (OptimizedModule, around a {type(part._orig_mod).__name__}), one graph that cannot be cut. Compile the"
            f" LightningModule instead, trainer.fit(torch.compile(model)): {_WHOLE_MODEL[strategy]}; or drop"
            f" torch.compile on `{attribute}`."
        )


def compile_stages(module: LightningModule, stages: Mapping[int, nn.Module], strategy: str) -> bool:
    """Under ``trainer.fit(torch.compile(model))``, compile each stage's ``forward`` with the model's context.

    Done the way Lightning's ``from_compiled`` compiles the LightningModule's methods: the stage modules are the
    strategy's own (built at each set-up), so nothing of the user's model is changed.

    Args:
        module: the LightningModule, compiled or not.
        stages: this process's stage modules by stage index.
        strategy: the strategy's name, for the log line.

    Returns:
        Whether the model was compiled (and so were the stages).

    """
    context: dict[str, Any] | None = getattr(module, "_compiler_ctx", None)
    if not context:
        return False
    for stage in stages.values():
        stage.forward = context["dynamo_ctx"](stage.forward)
    rank_zero_info(f"{strategy}: the model is compiled, so each stage is too (stages {sorted(stages)} on rank 0)")
    return True
