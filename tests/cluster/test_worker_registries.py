"""Each worker's one map of attempts by ticket (prefill_worker/jobs.py, decode_worker/receives.py):
live records are never dropped, the oldest ended ones go beyond the cap, an abort of an unknown
ticket leaves an ended record that refuses the call landing after it, and a receive noticed
before its reserve is one record from its first notice on."""

from __future__ import annotations

import asyncio

from halfmoon.decode_worker import receives as receives_module
from halfmoon.decode_worker.receives import Receives
from halfmoon.kvstore.transfer.channel import NoticeConn
from halfmoon.kvstore.transfer.notice_format import LayerNotice, TokenNotice
from halfmoon.prefill_worker import jobs as jobs_module
from halfmoon.prefill_worker.job import DirectPeer, Job
from halfmoon.prefill_worker.jobs import Jobs


def _job(key: str) -> Job:
    return Job(f"r-{key}", key, units=[], block_keys=[], peer=DirectPeer(None))


def test_a_live_job_outlives_the_cap_and_the_oldest_ended_jobs_go_first(monkeypatch):
    monkeypatch.setattr(jobs_module, "RECENT_JOBS", 2)
    jobs = Jobs()
    jobs.open(_job("long"))
    for key in ("k0", "k1", "k2"):
        job = _job(key)
        jobs.open(job)
        jobs.close(job)
    kept = [key for key in ("long", "k0", "k1", "k2") if jobs.find(key) is not None]
    assert kept == ["long", "k1", "k2"] and jobs.keys() == {"long"}


def test_an_abort_before_its_prefill_leaves_an_ended_job_the_prefill_finds_aborted():
    jobs = Jobs()
    jobs.abort("r1", "ticket-1")
    jobs.abort("r2", None)  # no ticket: nothing to refuse later
    placeholder = jobs.find("ticket-1")
    assert placeholder.ended and placeholder.aborted and jobs.get("ticket-1") is None
    assert jobs.find("r2") is None and jobs.keys() == set()
    job = _job("ticket-1")
    jobs.open(job)
    other = _job("ticket-2")
    jobs.open(other)
    assert job.aborted and jobs.get("ticket-1") is job and not other.aborted


def test_an_abort_of_a_live_job_marks_it_and_it_stays_marked_once_ended():
    jobs, job = Jobs(), _job("ticket-1")
    jobs.open(job)
    jobs.abort("r1", "ticket-1")
    jobs.close(job)
    assert jobs.find("ticket-1") is job and job.aborted and job.ended


def _notice(key: str, unit: int = 0) -> LayerNotice:
    return LayerNotice(key, unit, 0, 7, (1, 2))


def test_a_receive_noticed_before_its_reserve_is_the_same_record_once_reserved():
    async def scenario():
        receives, conn = Receives(), NoticeConn(None)
        first = receives.hold_early("t1", _notice("t1"), conn)
        again = receives.hold_early("t1", TokenNotice("t1", 5), conn)
        before = (receives.live("t1"), receives.ended("t1"), receives.find("t1"), len(receives))
        receive = receives.open("r1", "t1", num_tokens=16, direct=True)
        return first, again, before, receive, receives

    first, again, before, receive, receives = asyncio.run(scenario())
    assert (first, again, before) == (True, False, (None, None, None, 0))
    assert receive.phase == "receiving" and receive.request_id == "r1"
    assert [type(notice) for notice, _ in receive.early] == [LayerNotice, TokenNotice]
    assert receives.live("t1") is receive and receives.find("r1") is receive
    assert receives.drop_early("t1") == [] and receives.live("t1") is receive


def test_notices_whose_reserve_never_comes_leave_no_record():
    async def scenario():
        receives, conn = Receives(), NoticeConn(None)
        receives.hold_early("t1", _notice("t1"), conn)
        dropped = receives.drop_early("t1")
        return dropped, receives.find("t1"), receives.hold_early("t1", _notice("t1"), conn)

    dropped, found, first_again = asyncio.run(scenario())
    assert [notice.key for notice, _ in dropped] == ["t1"] and found is None and first_again


def test_live_and_early_receives_outlive_the_cap_and_the_oldest_ended_go_first(monkeypatch):
    monkeypatch.setattr(receives_module, "RECENT_ENDS", 2)

    async def scenario():
        receives = Receives()
        live = receives.open("r-live", "live", num_tokens=16, direct=False)
        receives.hold_early("early", _notice("early"), NoticeConn(None))
        for key in ("e0", "e1", "e2"):
            assert receives.end(receives.open(f"r-{key}", key, num_tokens=16, direct=False))
        return receives, live

    receives, live = asyncio.run(scenario())
    ended = [key for key in ("e0", "e1", "e2") if receives.ended(key) is not None]
    assert ended == ["e1", "e2"] and receives.live("live") is live and list(receives) == [live]
    assert receives.drop_early("early") != []
    assert not receives.end(receives.ended("e2"))  # an end happens once


def test_an_abort_before_the_reserve_refuses_it_and_gives_back_the_early_notices():
    async def scenario():
        receives, conn = Receives(), NoticeConn(None)
        receives.hold_early("noticed", _notice("noticed"), conn)
        returned = receives.abort("r1", "noticed"), receives.abort("r2", "unknown")
        return receives, returned, receives.abort("r3", None)

    receives, (noticed, unknown), untracked = asyncio.run(scenario())
    assert [notice.key for notice, _ in noticed] == ["noticed"] and unknown == untracked == []
    assert receives.refused("noticed") and receives.refused("unknown")
    assert not receives.refused(None) and not receives.refused("r3")
    assert receives.ended("unknown").request_id == "r2"
    assert receives.find("r2") is None and receives.find("unknown") is None  # never reserved
    assert receives.drop_early("noticed") == []


def test_a_live_attempt_is_found_by_its_request_id_before_one_that_ended_later():
    async def scenario():
        receives = Receives()
        first = receives.open("r1", "t1", num_tokens=16, direct=False)
        retry = receives.open("r1", "t2", num_tokens=16, direct=False)
        receives.end(first)
        live_first = receives.find("r1")
        receives.end(retry)
        return receives, first, retry, live_first

    receives, first, retry, live_first = asyncio.run(scenario())
    assert live_first is retry and receives.find("t1") is first
    assert receives.find("r1") is retry  # the latest to end
