import pytest

from lightning_dltune.settings import LoaderSettings


def test_zero_workers_normalizes_dependent_fields():
    s = LoaderSettings.normalized(0, prefetch_factor=4, persistent_workers=True)
    assert s == LoaderSettings(0, None, False, False)
    assert s.to_loader_kwargs() == {
        "num_workers": 0,
        "prefetch_factor": None,
        "pin_memory": False,
        "persistent_workers": False,
    }


def test_going_from_zero_to_workers_sets_prefetch_and_persistence():
    s = LoaderSettings.normalized(0).with_workers(8)
    assert (s.num_workers, s.prefetch_factor, s.persistent_workers) == (8, 2, True)
    assert s.with_workers(0) == LoaderSettings()


def test_user_choice_of_non_persistent_workers_is_kept_across_worker_changes():
    s = LoaderSettings.normalized(2, 3, persistent_workers=False).with_workers(6)
    assert (s.num_workers, s.prefetch_factor, s.persistent_workers) == (6, 3, False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_workers": -1}, r"`num_workers` must be a non-negative int, got -1"),
        ({"num_workers": 1.5}, r"`num_workers` must be a non-negative int"),
        ({"num_workers": 2, "prefetch_factor": 0}, r"`prefetch_factor` must be a positive int or None, got 0"),
        ({"num_workers": 0, "prefetch_factor": 2}, r"must be None when `num_workers=0`"),
        ({"num_workers": 0, "persistent_workers": True}, r"`persistent_workers=True` needs `num_workers > 0`"),
    ],
)
def test_invalid_settings_name_the_argument_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoaderSettings(**kwargs)


def test_cost_orders_fewer_workers_then_fewer_batches_in_flight():
    a, b, c = LoaderSettings.normalized(2, 2), LoaderSettings.normalized(2, 4), LoaderSettings.normalized(4, 2)
    assert sorted([c, b, a], key=lambda s: s.cost) == [a, b, c]


def test_round_trips_through_a_dict():
    s = LoaderSettings.normalized(5, 3, pin_memory=True)
    assert LoaderSettings.from_dict(s.to_loader_kwargs()) == s


def test_only_a_prefetch_change_is_one_the_running_workers_can_take():
    running = LoaderSettings.normalized(4, 2)
    assert running.only_prefetch_differs(running.with_prefetch(4))
    assert not running.only_prefetch_differs(running)
    assert not running.only_prefetch_differs(running.with_workers(8))
    assert not running.only_prefetch_differs(LoaderSettings.normalized(0))  # a switch down to 0 workers
    assert not running.only_prefetch_differs(LoaderSettings.normalized(4, 4, pin_memory=True))
    assert not LoaderSettings.normalized(0).only_prefetch_differs(running)
