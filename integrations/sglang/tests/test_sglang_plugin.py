"""Selection through SGLang's plugin mechanism, against SGLang's real code: the installed entry
point, SGLang's own plugin loader and hook registry, and the real ``TransferBackend`` /
``get_kv_class`` definitions from the wheel's ``disaggregation/utils.py`` (that module needs
SGLang's GPU stack to import, so its definitions are executed on their own)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from sgl_harness import real_utils_module

from kvwire_sglang import conn, plugin


@pytest.fixture
def sglang_utils(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from sglang.srt.arg_groups import choices
    from sglang.srt.plugins.hook_registry import HookRegistry

    mod = real_utils_module()
    monkeypatch.setitem(sys.modules, plugin.UTILS, mod)
    # SGLang's parser holds this very list: put its original contents back afterwards.
    saved = [c for c in choices.DISAGG_TRANSFER_BACKEND_CHOICES if c != plugin.BACKEND]
    choices.DISAGG_TRANSFER_BACKEND_CHOICES[:] = saved
    HookRegistry.reset()
    try:
        yield mod
    finally:
        HookRegistry.reset()
        choices.DISAGG_TRANSFER_BACKEND_CHOICES[:] = saved


def test_entry_point_is_found_by_sglangs_loader() -> None:
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    func, dist = found["kvwire"]
    assert func is plugin.register and dist == "kvwire-sglang"


def test_register_selects_kvwire_and_keeps_the_others(sglang_utils: Any) -> None:
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin.register()
    plugin.register()  # SGLang guards repeated loads; ours is idempotent too
    HookRegistry.apply_hooks()  # the queue hooks' modules need the GPU stack: logged, skipped
    assert choices.DISAGG_TRANSFER_BACKEND_CHOICES.count("kvwire") == 1
    tb, kt = sglang_utils.TransferBackend, sglang_utils.KVClassType
    member = tb("kvwire")  # what the scheduler does with --disaggregation-transfer-backend kvwire
    assert member is tb.KVWIRE and member in list(tb) and tb.NIXL.value == "nixl"
    get = sglang_utils.get_kv_class
    assert get(member, kt.MANAGER) is conn.KvwireKVManager
    assert get(member, kt.SENDER) is conn.KvwireKVSender
    assert get(member, kt.RECEIVER) is conn.KvwireKVReceiver
    assert get(member, kt.BOOTSTRAP_SERVER) is conn.KvwireKVBootstrapServer
    assert get(member, kt.KVARGS) is KVArgs
    assert get(tb.NIXL, kt.KVARGS) is KVArgs  # other backends reach SGLang's original
    with pytest.raises(ImportError):  # ... which imports SGLang's NIXL backend (not installed)
        get(tb.NIXL, kt.MANAGER)


def test_init_kv_manager_hook_passes_engine_facts() -> None:
    from kvwire_sglang.facts import current_facts

    seen: list[Any] = []

    class Model:
        num_hidden_layers = 30

        def get_total_num_kv_heads(self) -> int:
            return 8

    class Queue:
        transfer_backend = type("B", (), {"value": "kvwire"})()
        scheduler = type("S", (), {"model_config": Model(), "attn_tp_size": 4})()
        token_to_kv_pool = type("P", (), {"head_num": 2})()
        pp_size = 1

    plugin.init_kv_manager_hook(lambda q: seen.append(current_facts()), Queue())
    assert seen[0].total_kv_heads == 8 and seen[0].local_kv_heads == 2
    assert seen[0].num_layers == 30 and seen[0].attn_tp_size == 4
    assert current_facts().total_kv_heads is None  # only while the manager is built


def test_sglang_cli_accepts_the_backend_only_after_register(sglang_utils: Any) -> None:
    """What an operator types, through SGLang's real argument parser."""
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", "m", "--disaggregation-mode", "prefill"]
    argv += ["--disaggregation-transfer-backend", "kvwire"]
    with pytest.raises(SystemExit):
        prepare_server_args(argv)
    plugin.register()
    args = prepare_server_args(argv)
    value = getattr(args, "disaggregation_transfer_backend", None)
    if value is None:  # namespaced ServerArgs
        value = args.disagg.disaggregation_transfer_backend
    assert value == "kvwire"


def test_facts_from_queue_reads_window_and_draft_heads() -> None:
    """The hook's facts from a queue shaped like SGLang 0.5.23's: the scheduler's
    ``sliding_window_size``, the draft pool's ``head_num`` and the draft worker's model config
    (``draft_runner``); no draft pool: no draft facts."""
    from types import SimpleNamespace as Ns

    from kvwire_sglang.plugin import facts_from_queue

    model = Ns(num_hidden_layers=4, get_total_num_kv_heads=lambda: 8)
    draft = Ns(draft_runner=Ns(model_config=Ns(get_total_num_kv_heads=lambda: 4)))
    scheduler = Ns(model_config=model, attn_tp_size=2, sliding_window_size=128, draft_worker=draft)
    queue = Ns(
        scheduler=scheduler,
        token_to_kv_pool=Ns(head_num=4),
        draft_token_to_kv_pool=Ns(head_num=2),
        pp_size=1,
    )
    f = facts_from_queue(queue)
    assert (f.attn_tp_size, f.num_layers, f.total_kv_heads, f.local_kv_heads) == (2, 4, 8, 4)
    assert (f.sliding_window, f.draft_total_kv_heads, f.draft_local_kv_heads) == (128, 4, 2)
    queue.draft_token_to_kv_pool = None
    f = facts_from_queue(queue)
    assert (f.draft_total_kv_heads, f.draft_local_kv_heads) == (None, None)
