"""Errors a user can cause. The CLI prints these as one clear message, without a traceback."""


# What a user is told when a run stops on a fault: its last checkpoint continues it.
RESUME_HINT = "The run stops here; `make train RESUME=checkpoints/<run id>/last.ckpt` continues it from its last checkpoint"


class ConfigError(ValueError):
    """An invalid configuration value: the message names the option and what would be valid."""


def check_choice(flag: str, value, choices) -> None:
    """Raise a ConfigError naming `flag` and the valid values unless `value` is one of `choices` (a
    sequence or a `typing.Literal`). The CLI already refuses such values while parsing; this covers
    modules built from Python."""
    from typing import get_args

    valid = get_args(choices) or tuple(choices)
    if value not in valid:
        raise ConfigError(f"{flag}={value!r}; valid: {', '.join(map(str, valid))}")


class RunStalled(RuntimeError):
    """No training step finished within the watchdog's bound: the message says how long, and where the stacks
    and the state of the rollout were written."""


class RunStopped(RuntimeError):
    """The run was stopped by a signal (SIGTERM, SIGINT): the message says where and which checkpoint holds it;
    `exit_code` is the shell's for that signal (143, 130)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def error_chain(err: BaseException):
    """`err`, then what caused it, outermost first."""
    seen = set()
    while err is not None and id(err) not in seen:
        yield err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
