"""Patch reattach pins the vLLM functions it relies on by a digest of their source. vLLM 0.32.0 changed
two of them only by dropping the blank line after the docstring (vllm/v1/engine/core.py:1831 and
:1933; docs/engine-versions.md): such a change must not skip the patch, a change of code or comment
must (issue 42). No vLLM: the functions are written to modules of their own."""

from __future__ import annotations

import importlib.util

from omnistage_engine_patches.patches import reattach

V030 = '''
class EngineCoreProc:
    def process_input_sockets(self, input_addresses, ready_event):
        """Input socket IO thread."""

        # Msgpack serialization decoding.
        poller = make_poller(input_addresses)   
        while True:
            poller.poll()
'''
V032_BLANK_LINES = V030.replace('thread."""\n\n', 'thread."""\n').replace(")   \n", ")\n") + "\n\n"
V_CODE = V030.replace("while True:", "while not self.stopped:")
V_COMMENT = V030.replace("# Msgpack serialization decoding.", "# Msgpack decoding, tensors by IPC.")


def _method(tmp_path, name: str, source: str):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EngineCoreProc.process_input_sockets


def test_blank_lines_and_trailing_whitespace_do_not_change_the_digest(tmp_path):
    assert V032_BLANK_LINES != V030
    assert reattach.digest(_method(tmp_path, "v030", V030)) == \
        reattach.digest(_method(tmp_path, "v032", V032_BLANK_LINES))


def test_a_change_of_code_or_comment_changes_the_digest(tmp_path):
    pinned = reattach.digest(_method(tmp_path, "v030", V030))
    assert reattach.digest(_method(tmp_path, "code", V_CODE)) != pinned
    assert reattach.digest(_method(tmp_path, "comment", V_COMMENT)) != pinned


def test_normalized_keeps_every_line_of_code_in_order():
    assert reattach.normalized("a = 1   \n\n\n    b = 2\n  \n") == "a = 1\n    b = 2"
