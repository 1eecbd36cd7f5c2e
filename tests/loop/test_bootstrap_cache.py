"""The cached base model's manifest points at the folder it is read from, wherever that moved."""

from loop.bootstrap import BaseModelManifest


def test_moved_cache_folder_loads_with_its_own_path(tmp_path):
    old = tmp_path / "old" / "base-abc"
    old.mkdir(parents=True)
    BaseModelManifest("base_model", str(old), "abc", 1, 1, 1.0, 0.5, {}, {}, 0.0).save(old)
    new = tmp_path / "new" / "base-abc"
    new.parent.mkdir()
    old.rename(new)
    m = BaseModelManifest.load(new)
    assert m.path == str(new.resolve()) and m.key == "abc"


def test_the_base_evaluation_leaves_no_engine_behind(tiny_base, tiny_cfg, tmp_path):
    """`loop run` evaluates a freshly built base on vLLM, then runs all its cycles: the engine it
    made for that (an engine-core process with its own memory) must be gone when it returns."""
    import dataclasses
    import shutil
    import time

    import psutil

    from loop.bootstrap import evaluate_with_vllm

    def engine_cores() -> list:
        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE and "EngineCore" in " ".join(p.cmdline() or [p.name()]):
                    out.append(p)
            except psutil.Error:  # gone meanwhile
                pass
        return out

    folder = shutil.copytree(tiny_base.path, tmp_path / "base")
    before = {p.pid for p in engine_cores()}  # the session's shared engine, if any
    m = dataclasses.replace(tiny_base, path=str(folder))
    res = evaluate_with_vllm(m, dataclasses.replace(tiny_cfg.task, num_eval_problems=4), tiny_cfg.engine)
    assert res["num_problems"] == 4 and 0 <= res["vllm_t1"] <= 1
    deadline = time.monotonic() + 30  # (shutdown is asynchronous)
    while (left := [p for p in engine_cores() if p.pid not in before]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
