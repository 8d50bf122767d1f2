"""The prefill worker's one map of attempts (prefill_worker/jobs.py): each attempt is found by
its key, an ended one answers `stored` and `publish_time`, and the ended ones are bounded."""

from __future__ import annotations

import asyncio

from halfmoon.prefill_worker import jobs as jobs_module
from halfmoon.prefill_worker.job import DirectPeer, Job, Lend
from halfmoon.prefill_worker.jobs import Jobs


def _job(request_id: str, key: str) -> Job:
    return Job(request_id, key, units=[], block_keys=[], peer=DirectPeer(None))


def test_a_retry_is_its_own_job_and_the_first_attempt_ends_alone():
    jobs = Jobs()
    first, retry = _job("r1", "ticket-1"), _job("r1", "ticket-2")
    jobs.open(first)
    jobs.open(retry)
    jobs.close(first)
    assert jobs.get("ticket-1") is None and jobs.get("ticket-2") is retry
    assert jobs.find("ticket-1") is first and jobs.keys() == {"ticket-2"}


def test_an_ended_job_answers_stored_with_its_flush_outcome():
    async def flushed() -> tuple[str | None, str | None, str | None]:
        jobs, job = Jobs(), _job("r1", "ticket-1")
        jobs.open(job)
        jobs.close(job)
        job.published.flush = asyncio.get_running_loop().create_task(asyncio.sleep(0))
        job.published.failure = "the store refused the layer"
        return await jobs.stored("ticket-1"), await jobs.stored("unknown"), jobs.num_flushing()

    assert asyncio.run(flushed()) == ("the store refused the layer", None, 0)


def test_publish_time_is_the_latest_attempt_of_the_request():
    jobs = Jobs()
    first, retry, other = _job("r1", "t1"), _job("r1", "t2"), _job("r2", "t3")
    first.published.published_at, retry.published.published_at = 5.0, 7.0
    for job in (first, retry, other):
        jobs.open(job)
    jobs.close(first)
    assert jobs.published_at("r1") == 7.0
    assert jobs.published_at("r2") is None and jobs.published_at("never") is None


def test_only_pages_still_lent_to_a_socket_are_found_for_it():
    jobs = Jobs()
    held, answered, elsewhere = _job("a", "ka"), _job("b", "kb"), _job("c", "kc")
    held.lend, answered.lend = Lend("/sock/1"), Lend("/sock/1", decode_done=True)
    elsewhere.lend = Lend("/sock/2")
    for job in (held, answered, elsewhere):
        jobs.open(job)
    jobs.close(held)
    assert jobs.lent_to("/sock/1") == [held]


def test_only_the_most_recent_ended_jobs_are_kept(monkeypatch):
    monkeypatch.setattr(jobs_module, "RECENT_JOBS", 2)
    jobs = Jobs()
    for index in range(3):
        job = _job(f"r{index}", f"k{index}")
        jobs.open(job)
        jobs.close(job)
    assert [jobs.find(f"k{index}") is not None for index in range(3)] == [False, True, True]
