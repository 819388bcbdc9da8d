import torch
from lightning.fabric.utilities.data import _replace_dunder_methods
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from lightning_dltune.switching._lightning import rebuild_dataloader

DATA = list(range(32))
TUNED = {"num_workers": 2, "prefetch_factor": 3, "pin_memory": False, "persistent_workers": True}


def collate(batch):
    return torch.tensor(batch) * 10


def init_fn(worker_id):
    pass


class MyLoader(DataLoader):
    def __init__(self, data, tag="x", **kwargs):
        self.tag = tag
        super().__init__(data, **kwargs)


def recorded(factory):
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        return factory()


def test_positional_arguments_are_passed_by_name():
    dl = recorded(lambda: DataLoader(DATA, 8, False))
    new = recorded(lambda: rebuild_dataloader(dl, TUNED))
    assert (new.batch_size, new.num_workers, new.prefetch_factor, new.persistent_workers) == (8, 2, 3, True)
    assert getattr(new, "__pl_saved_args") == ()  # Lightning can rebuild it again
    assert getattr(dl, "__pl_saved_kwargs") == {}  # the original's record is untouched


def test_custom_pieces_survive_a_rebuild():
    g = torch.Generator()
    batch_sampler = BatchSampler(SequentialSampler(DATA), batch_size=5, drop_last=True)
    dl = recorded(
        lambda: MyLoader(
            DATA,
            tag="mine",
            batch_sampler=batch_sampler,
            collate_fn=collate,
            worker_init_fn=init_fn,
            generator=g,
            num_workers=1,
            multiprocessing_context="fork",
        )
    )
    to_zero = {"num_workers": 0, "prefetch_factor": None, "persistent_workers": False}
    new = recorded(lambda: rebuild_dataloader(dl, to_zero))
    assert new.multiprocessing_context is None  # PyTorch rejects a context without workers
    back = recorded(lambda: rebuild_dataloader(new, TUNED))
    assert back.multiprocessing_context is dl.multiprocessing_context
    assert type(new) is MyLoader and new.tag == "mine"
    assert new.collate_fn is collate and new.worker_init_fn is init_fn and new.generator is g
    assert new.batch_sampler.batch_size == 5 and new.batch_sampler.drop_last
    assert [b.tolist() for b in new][:2] == [[0, 10, 20, 30, 40], [50, 60, 70, 80, 90]]


def test_a_loader_built_outside_the_hook_is_rebuilt_from_its_attributes():
    dl = DataLoader(DATA, batch_size=4, shuffle=True, num_workers=0)
    new = rebuild_dataloader(dl, TUNED)
    assert (new.batch_size, new.num_workers, new.persistent_workers) == (4, 2, True)
    assert sorted(x for b in new for x in b.tolist()) == DATA
    new._iterator._shutdown_workers()
