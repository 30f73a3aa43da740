"""The server layer: ``serve``, the OpenAI-compatible HTTP server (``server``), the scheduler
thread that owns the engine, request parsing (``openai_api``), metrics, streaming detokenisation,
``serve``'s settings (``serve_config``) and ``launch`` (run ``serve`` as a child process).
Built on ``serving.engine``; the draft and target roles use ``serving.distributed``."""
