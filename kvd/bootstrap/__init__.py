"""HTTP plane: SGLang-compatible bootstrap ``/route`` API, ``/health``, embedded uvicorn."""
