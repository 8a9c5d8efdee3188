"""The one error every service raises when a port it must listen on cannot be bound."""


class BindError(RuntimeError):
    """A service's port (gRPC, metrics, HTTP) cannot be bound: the service does not start
    (`pdmesh serve` prints the message and exits 1)."""
