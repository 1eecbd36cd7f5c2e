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
