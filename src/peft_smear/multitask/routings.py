"""Which routing methods ``peft-smear train`` offers, read from their router classes' traits (imported when asked:
the command's arguments are parsed without them)."""

from __future__ import annotations


def over_existing_adapters(routing: str) -> str:
    """Why ``train`` does not train ``routing``, a method made for a bank of existing adapters."""
    return (
        f"{routing!r} routes over a bank of existing, separately trained adapters, and `train` trains its experts "
        f"from scratch: train one LoRA adapter per task, then build the bank with `peft-smear build-bank --routing "
        f"{routing}`."
    )


def why_not_trainable(routing: str) -> str | None:
    """Why ``train`` cannot train ``routing`` (a registered method), read from its router class's traits, or ``None``
    when it can: ``train`` trains experts and routing together from scratch, gives every call only the task ids, and
    reports one routing distribution per example and router."""
    from ..bank import BankRouter
    from ..core.routers import ROUTERS
    from ..routers import TASK_IDS

    router = ROUTERS[routing]
    if issubclass(router, BankRouter):
        return over_existing_adapters(routing)
    if router.per_token:
        return f"{routing!r} routes every token on its own; `train` reports one routing per example and router."
    missing = [call_input.name for call_input in router.call_inputs if call_input is not TASK_IDS]
    if missing:
        return f"{routing!r} needs {', '.join(missing)} in every call, which `train` does not provide."
    return None


def trainable_routings() -> list[str]:
    """The registered routing methods ``train`` offers."""
    from ..core.routers import ROUTERS

    return [name for name in ROUTERS if why_not_trainable(name) is None]
