"""opd.utils.config.resolve_auto: ``auto`` resolved by the caller's choice, an explicit setting kept."""

from opd.utils.config import resolve_auto


def test_auto_is_chosen_and_an_explicit_setting_kept() -> None:
    assert resolve_auto("auto", lambda: "nccl") == "nccl"
    assert resolve_auto("gloo", lambda: "nccl") == "gloo"
    assert resolve_auto(False, lambda: True) is False
