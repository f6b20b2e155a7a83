"""Closing a run's engines, servers, teacher and pools when it stops on an error.

Lightning calls a module's `teardown` only when fit ends normally; an error reaches the callbacks'
`on_exception` instead. Without this, a run stopped by an error (a lost replica, the watchdog) would keep its
engines until the interpreter's exit, which first joins every pool thread still waiting on them."""

from __future__ import annotations

import lightning as L


class CloseOnError(L.Callback):
    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        pl_module.teardown("fit")
