"""An OpenAI-compatible HTTP server over the engine (`specdraft serve`); needs the `server` extra.

    from specdraft.server import create_app, make_server
    app = create_app(llm.engine, llm.tokenizer, "smollm2-135m")
    make_server(app, port=8000).run()

Imported lazily, so that the CLI (which registers `serve`) runs without FastAPI installed.
"""

from typing import Any

__all__ = ["ServedModel", "Server", "create_app", "create_app_lazy", "make_server", "serve_in_thread"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from specdraft.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'specdraft.server' has no attribute {name!r}")
