"""A DataLoader whose position in the epoch survives a checkpoint: what a resumed run continues from."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DataLoader, Dataset

from attnlab.data.samplers import LengthBucketSampler


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `LengthBucketSampler` whose position survives a checkpoint.

    Lightning saves ``state_dict()`` of every training dataloader that has one into the checkpoint
    (``loops.fit_loop.state_dict.combined_loader``) and calls ``load_state_dict`` on resume, before
    it starts iterating; the next pass then yields only the batches the interrupted epoch had left.
    The position counted here is what the training loop *received*, not what the sampler handed
    out: worker processes prefetch batches ahead of the loop.

    Give it a ``generator``: the DataLoader then draws its workers' base seed from it rather than
    from torch's global generator, so creating an iterator (every epoch, every validation) does
    not shift the random stream that dropout uses, and a resumed run sees the same stream.
    """

    def __init__(self, dataset: Dataset, batch_sampler: LengthBucketSampler, **kwargs):
        if not isinstance(batch_sampler, LengthBucketSampler):
            raise TypeError(
                f"ResumableDataLoader needs a LengthBucketSampler, got {type(batch_sampler).__name__}"
            )
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self._consumed: tuple[int, int] | None = None  # (epoch, next batch) as the consumer saw it

    def __iter__(self) -> Iterator:
        self._consumed = None
        for batch in super().__iter__():
            if self._consumed is None:  # the sampler's pass has started: its epoch and start are known
                self._consumed = (self.batch_sampler.epoch, self.batch_sampler.pass_start)
            epoch, position = self._consumed
            self._consumed = (epoch, position + 1)
            yield batch

    def state_dict(self) -> dict:
        if self._consumed is None:
            return self.batch_sampler.state_dict()
        return self.batch_sampler.position_state(*self._consumed)

    def load_state_dict(self, state: dict) -> None:
        self._consumed = None
        self.batch_sampler.load_state_dict(state)
