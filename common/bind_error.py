"""The one error every service raises when a port it must listen on cannot be bound."""


EXIT_CODE = 3    # `pdmesh serve`'s exit status when its port was taken: the launcher may pick another


class BindError(RuntimeError):
    """A service's port (gRPC, metrics, HTTP) cannot be bound: the service does not start
    (`pdmesh serve` prints the message and exits EXIT_CODE)."""
