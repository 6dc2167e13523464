"""The errors the backends layer raises on purpose, in one small tree::

    BackendError
    ├── WorkerExists        registry: a worker with this id (its normalised URL) is registered
    ├── WorkerNotFound      registry: no worker has this id
    ├── DiscoveryUrlError   a ``--discover`` URL that cannot be used (also a ValueError)
    └── ProcessExited       a child process (``backends.process``) exited before it was
                            ready (also a RuntimeError; not ready in time is a TimeoutError)

None of them knows HTTP: the router maps the registry's to its own client errors
(``router.errors.from_backend``). Messages name workers by their id, never a credential.
"""

from __future__ import annotations


class BackendError(Exception):
    """Base of every error the backends layer raises on purpose."""


class WorkerExists(BackendError):
    """``WorkerRegistry.add``: the worker's id is taken."""

    def __init__(self, worker: str) -> None:
        super().__init__(f"worker {worker!r} is already registered")
        self.worker = worker


class WorkerNotFound(BackendError):
    """``WorkerRegistry.get`` / ``remove``: no worker has this id."""

    def __init__(self, worker: str) -> None:
        super().__init__(f"no worker {worker!r} is registered")
        self.worker = worker


class DiscoveryUrlError(BackendError, ValueError):
    """A ``--discover`` URL that cannot be used; the message says what to fix."""


class ProcessExited(BackendError, RuntimeError):
    """A supervised child process exited while we waited for it to become ready."""

    def __init__(self, message: str, *, name: str, returncode: int | None) -> None:
        super().__init__(message)
        self.name = name
        self.returncode = returncode
