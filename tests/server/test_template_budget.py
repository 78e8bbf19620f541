"""A checkpoint's chat template that loops, recurses, or asks for more memory or text than exists: each render ends
with a ChatTemplateError within the renderer's budget, and the renderer keeps rendering for the next request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corelib.errors import ConfigError
from corelib.server.chat import ChatTemplate, ChatTemplateError
from corelib.server.render import TemplateRenderer
from server.servekit import alive

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Hi"}]
TIMEOUT_S = 3.0  # the hostile renders never end; a benign one takes about a millisecond
# Benign on the one-message probe at start, hostile once a conversation has a second message.
TRIGGER = "{% if messages|length > 1 %}HOSTILE{% endif %}{{ messages[0]['content'] }}"
HOSTILE = {
    "nested-ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "repeat-the-list": "{{ (messages * 10**9)|length }}",
    "tojson-indent": "{{ messages|tojson(indent=10**9) }}",
    "recursive-macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "huge-string": "{{ 'x' * 10**12 }}",
    "range-over-the-limit": "{% for i in range(10**7) %}{% endfor %}",
    "huge-center": "{{ 'x'|center(10**10) }}",
    "output-beyond-the-context": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "own-refusal": "{{ raise_exception('no second message, please') }}",
}


# Constant output is evaluated as the template compiles: 600 MB of text, then its repr, beyond the renderer's
# 1 GiB. That happens in the renderer, under its limits, at start; in the server's process it would just take memory.
AT_COMPILE = {
    "format-width": "{{ '%600000000s'|format('x') }}",
    "center": "{{ 'x'|center(6 * 10**8) }}",
}


@pytest.fixture(scope="module")
def renderers() -> Iterator[dict[str, TemplateRenderer]]:
    started: dict[str, TemplateRenderer] = {}
    try:
        for name, body in HOSTILE.items():
            source = TRIGGER.replace("HOSTILE", body)
            renderer = TemplateRenderer(ChatTemplate(source, f"test:{name}"), max_chars=1 << 20, workers=1,
                                        timeout_s=TIMEOUT_S)
            renderer.start()
            started[name] = renderer
        yield started
    finally:
        for renderer in started.values():
            renderer.close()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_ends_in_a_template_error_and_the_renderer_recovers(
    renderers: dict[str, TemplateRenderer], name: str
) -> None:
    renderer = renderers[name]
    with pytest.raises(ChatTemplateError) as caught:
        renderer.render_blocking([*MESSAGES, {"role": "user", "content": "again"}])
    assert "\n" not in str(caught.value)
    assert renderer.render_blocking(MESSAGES) == "Hi", "the renderer did not recover"


@pytest.mark.parametrize("name", list(AT_COMPILE))
def test_a_template_that_explodes_as_it_compiles_is_refused_at_start_and_this_process_never_compiles_it(
    name: str
) -> None:
    source = TRIGGER.replace("HOSTILE", AT_COMPILE[name])
    template = ChatTemplate(source, f"test:{name}")  # parsed here, not compiled
    renderer = TemplateRenderer(template, max_chars=1 << 20, workers=1, timeout_s=TIMEOUT_S)
    with pytest.raises(ConfigError, match=rf"test:{name}: the chat template cannot be compiled: MemoryError"):
        renderer.start()
    assert template._template is None, "the template was compiled in the server's own process"


def test_a_template_that_fails_the_probe_is_refused_at_start() -> None:
    renderer = TemplateRenderer(ChatTemplate("{{ raise_exception('never') }}", "test:probe"), max_chars=1 << 20,
                                workers=1, timeout_s=TIMEOUT_S)
    with pytest.raises(ConfigError, match=r"test:probe fails on a one-message conversation .*never"):
        renderer.start()


def test_the_fallback_template_renders_in_process() -> None:
    renderer = TemplateRenderer(ChatTemplate.load(None), max_chars=1 << 20)
    renderer.start()
    try:
        assert renderer.render_blocking(MESSAGES) == "user: Hi\nassistant:"
    finally:
        renderer.close()


def test_a_renderer_stuck_in_a_render_ends_with_the_server_that_started_it(tmp_path: Path) -> None:
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent("""
        import sys
        from corelib.server.chat import ChatTemplate
        from corelib.server.render import TemplateRenderer
        template = ChatTemplate(sys.argv[1], "t")
        renderer = TemplateRenderer(template, max_chars=1 << 20, workers=1, timeout_s=3600)
        renderer.start()
        print(renderer._workers[0].process.pid, flush=True)
        renderer.render_blocking([{"role": "user", "content": "a"}] * 2)
    """))
    hostile = TRIGGER.replace("HOSTILE", HOSTILE["nested-ranges"])
    server = subprocess.Popen([sys.executable, str(script), hostile], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    worker = int(server.stdout.readline())
    os.kill(server.pid, signal.SIGKILL)  # the server dies in the middle of the render
    server.wait(30)
    deadline = time.monotonic() + 60
    while alive(worker):
        assert time.monotonic() < deadline, f"render worker {worker} outlived its server"
        time.sleep(0.05)
