"""Why the scheduler could not place a request. The HTTP layer maps each to its client error
(``router.errors.from_scheduling``)."""

from __future__ import annotations


class SchedulingError(Exception):
    """Base of the scheduler's refusals."""


class ModelNotFound(SchedulingError):
    """No worker (healthy or not) serves the model."""

    def __init__(self, model: str) -> None:
        super().__init__(f"no worker serves model {model!r}")
        self.model = model


class NoHealthyWorker(SchedulingError):
    """Workers serve the model, but none that may take the request is ready."""

    def __init__(self, model: str) -> None:
        super().__init__(f"no ready worker serves model {model!r}")
        self.model = model


class QueueFull(SchedulingError):
    """The queue, or the share of it a key or model may hold, is full; ``code`` says which
    (``queue_full``, ``key_queue_full``, ``model_queue_full``)."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class QueueTimeout(SchedulingError):
    """The request waited queued until its deadline (or kvgate stopped)."""

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"waited {waited_s:.3g} s queued")
        self.waited_s = waited_s


class ClientGone(SchedulingError):
    """The client went away while its request was queued."""


class ResponseUnknown(SchedulingError):
    """A stored response this client key did not create through kvgate, or one forgotten
    (``param``: the request field that named it)."""

    def __init__(self, response_id: str, param: str) -> None:
        super().__init__(f"{response_id} is not a response kvgate holds for this client")
        self.response_id = response_id
        self.param = param


class ResponseHolderGone(SchedulingError):
    """The worker that produced a stored response has left the fleet."""

    def __init__(self, response_id: str, worker: str) -> None:
        super().__init__(f"{response_id} was produced by {worker}, which has left")
        self.response_id = response_id
        self.worker = worker


class ResponseHolderUnavailable(SchedulingError):
    """The worker that produced a stored response cannot take a request now."""

    def __init__(self, response_id: str, worker: str, why: str) -> None:
        super().__init__(f"{response_id} is held by {worker}, which is {why}")
        self.response_id = response_id
        self.worker = worker
        self.why = why
