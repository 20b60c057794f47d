"""Static shapes shared by every engine: prompts padded to prefill buckets, batches to batch buckets,
and one cache size and step count fixed for the whole run, so a static mode's shapes repeat (warm-up
covers each one; compiled code and CUDA graphs are reused). Eager modes keep each batch's own shapes."""

from __future__ import annotations


def bucket_size(value: int, buckets: list[int] | tuple[int, ...]) -> int:
    """Smallest bucket >= value; past the largest, the next multiple of the largest."""
    for bucket in sorted(buckets):
        if bucket >= value:
            return bucket
    largest = max(buckets)
    return -(-value // largest) * largest


class ShapePlan:
    """Padding and run-wide sizes of an engine; the engine sets `static`, `prefill_buckets` and
    `batch_buckets`, and `plan` fixes `plan_slots` and `plan_steps` before the first batch."""

    static: bool
    prefill_buckets: tuple[int, ...]
    batch_buckets: tuple[int, ...]
    plan_slots: int | None = None
    plan_steps: int | None = None

    def plan(self, max_prompt_length: int, max_steps: int) -> None:
        """Fix the cache size and step count of every static workspace or cache of the run."""
        self.plan_slots = self.padded_length_for(max_prompt_length) + max_steps
        self.plan_steps = max_steps

    def padded_length_for(self, length: int) -> int:
        return bucket_size(length, self.prefill_buckets) if self.static else length

    def padded_length(self, prompts: list[list[int]]) -> int:
        return self.padded_length_for(max(len(ids) for ids in prompts))

    def padded_batch(self, rows: int) -> int:
        return bucket_size(rows, self.batch_buckets) if self.static else rows
