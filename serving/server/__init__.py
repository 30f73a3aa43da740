"""The server layer: ``serve`` (``cli_serve``), the OpenAI-compatible HTTP app (``app``: its routes
and the ``Backend`` protocol) over one of two backends, the Choral engine (``server``, with the
``scheduler`` thread that owns the engine) or a front over pools of vLLM replicas
(``vllm_backend``); what both share: the HTTP helpers (``http``), request parsing
(``openai_api``), metrics and ``serve``'s settings (``serve_config``); streaming detokenisation,
the request log, and ``launch`` (run ``serve`` as a child process). Built on ``serving.engine``;
the draft and target roles use ``serving.distributed``."""
