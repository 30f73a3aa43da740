"""The distributed layer: the target as a gRPC service (``verify_service``) and the draft node's
client (``remote``), over the protocol in ``verify.proto``. Built on ``serving.engine`` only.

``verify_pb2.py`` and ``verify_pb2_grpc.py`` are generated: after editing ``verify.proto``,
regenerate them from the repository root with

    python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. serving/distributed/verify.proto
"""

SESSION_TIMEOUT_S = 60.0
"""How long the target keeps an idle session's KV cache: the one default of ``serve``'s
``session_timeout_s`` and of ``VerifyServer``/``VerifyService``."""
