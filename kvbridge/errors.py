"""Every error a user can cause, named. Each message says what to do about it."""


class KVBridgeError(Exception):
    """Base of every kvbridge error."""


class ConfigError(KVBridgeError, ValueError):
    """A config value is invalid; the message names the field and the accepted values."""


class SamplingParamsError(ConfigError):
    """A `SamplingParams` value is out of range. `field` names it (the HTTP API's 400 names it too)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class ConnectorNotFoundError(ConfigError):
    """No connector is registered under the configured name."""


class MissingDependencyError(ConfigError):
    """A third-party module that a configured feature needs is missing or fails to import."""


class NixlNotAvailableError(KVBridgeError, ImportError):
    """NIXL is not installed or its backend plugin cannot be created."""


class TransferError(KVBridgeError):
    """A KV transfer failed."""


class PlanTooLargeError(TransferError):
    """A read between two layouts would list more pages and token chunks than planning may hold in memory."""


class PeerUnreachableError(TransferError):
    """The peer's side channel did not answer within the deadline."""


class HandshakeError(TransferError):
    """The handshake with a peer failed."""


class IncompatiblePeerError(HandshakeError):
    """The peer runs a different protocol version, model, dtype or KV layout."""


class AuthenticationError(TransferError):
    """A side-channel message was not signed with the shared secret (or was replayed)."""


class MalformedMessageError(TransferError):
    """Bytes that do not decode to a known side-channel message."""


class TransferTimeoutError(TransferError):
    """A transfer passed its deadline."""


class FlushTimeoutError(KVBridgeError, TimeoutError):
    """Transfers were still in flight when a flush deadline passed.

    `pending_req_ids` names the requests whose transfers were still in flight.
    """

    def __init__(self, message: str, pending_req_ids: frozenset[str] = frozenset()):
        super().__init__(message)
        self.pending_req_ids = pending_req_ids


class KVLoadError(KVBridgeError):
    """External KV could not be loaded for a request and the failure policy is `fail`."""


class ModelLoadError(KVBridgeError):
    """A model checkpoint directory is missing, incomplete or of an unsupported architecture."""


class ModelNotFoundError(ModelLoadError, ConfigError):
    """The model names neither a built-in preset nor a local directory: a bad `--model`, not a bad checkpoint."""


class InvalidRequestError(KVBridgeError, ValueError):
    """An HTTP API request is malformed (bad JSON, a missing or mistyped field); the server answers 400.

    `param` names the offending request field, if one is to blame.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PortInUseError(ConfigError):
    """A server's address is taken (or cannot be bound); the message names the host and port."""


class NodeStartError(KVBridgeError):
    """A node or proxy subprocess exited or did not become healthy before its deadline; see its log."""


class EngineShutdownError(KVBridgeError, RuntimeError):
    """An engine was used after `shutdown()`; build a new one."""


class EngineStalledError(KVBridgeError, TimeoutError):
    """Requests made no progress for longer than the deadline (e.g. waiting on KV that never arrives)."""


class TensorParallelError(ConfigError):
    """A tensor_parallel_size the model or the machine cannot run (it must divide the attention heads;
    on CUDA, N ranks need N GPUs), or a combination TP does not support yet (a KV connector)."""


class PipelineParallelError(ConfigError):
    """A pipeline_parallel_size > 1 where kvbridge moves KV: its connectors hold every layer of a block on one
    rank (each TP rank its heads of all layers), and no connector splits a request's layers across stages."""
