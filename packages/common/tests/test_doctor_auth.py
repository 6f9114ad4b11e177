"""The doctor's pure checks: the authentication row, from what each node reports and where the
dashboard listens; the object store against /dev/shm."""

from __future__ import annotations

import pytest

from raytrain_common.doctor import (
    FAIL,
    OK,
    WARN,
    Report,
    Shape,
    check_auth,
    check_launcher_variables,
    check_system,
)

TOKEN, OFF = {"auth_mode": "token"}, {"auth_mode": "disabled"}


@pytest.mark.parametrize(
    ("facts", "dashboard", "status"),
    [
        ({"a": TOKEN, "b": TOKEN}, "10.0.0.5:8265", OK),  # tokens: exposed is fine
        ({"a": OFF}, "127.0.0.1:8265", WARN),  # one node, loopback only: a laptop
        ({"a": OFF}, None, WARN),
        ({"a": OFF}, "10.0.0.5:8265", FAIL),  # the dashboard listens beyond loopback
        ({"a": OFF, "b": OFF}, "127.0.0.1:8265", FAIL),  # other machines reach this cluster
        ({"a": TOKEN, "b": OFF}, "127.0.0.1:8265", FAIL),  # one node without it is a way in
    ],
)
def test_token_authentication_is_ok_and_its_absence_warns_or_fails(
    facts: dict, dashboard: str | None, status: str
) -> None:
    report = Report(Shape())
    check_auth(report, facts, dashboard)
    [row] = report.rows
    assert (row.check, row.status) == ("authentication", status), row
    if status != OK:
        assert "RAY_AUTH_MODE=token" in row.fix and "authOptions.mode: token" in row.fix


def test_a_launchers_rendezvous_variables_fail_in_the_driver_and_warn_on_a_node() -> None:
    """What `deepspeed` or `torchrun` leaves (or a hand-set MASTER_PORT): in the driver `train`
    refuses to start; on a node, code reading them before Ray Train sets them meets another
    rendezvous."""
    report = Report(Shape())
    clean: dict = {"launcher_variables": {}}
    check_launcher_variables(report, {"a": clean, "b": clean}, clean)
    [row] = report.rows
    assert (row.check, row.status) == ("launcher variables", OK), row
    report = Report(Shape())
    launched = {"launcher_variables": {"MASTER_PORT": "29500", "LOCAL_RANK": "3"}}
    check_launcher_variables(report, {"a": clean, "b": launched}, launched)
    assert [(row.node, row.status) for row in report.rows] == [("driver", FAIL), ("b", WARN)]
    assert report.rows[0].value == "MASTER_PORT=29500, LOCAL_RANK=3"
    assert "Ray Train sets them for each worker" in report.rows[1].fix


GIB = 1 << 30


@pytest.mark.parametrize(
    ("store", "shm", "status"),
    [
        (8 * GIB, 10 * GIB, OK),  # deploy/rayjob's workers: the store lives in memory
        (9.6 * GIB, 8 * GIB, WARN),  # Ray's default 30 % of 32 GiB over an 8 GiB /dev/shm: on disk
    ],
)
def test_an_object_store_larger_than_dev_shm_warns_that_ray_puts_it_on_disk(
    store: float, shm: int, status: str
) -> None:
    report = Report(Shape())
    node = {"shm_total": shm, "object_store_memory": store, "disk_free": {}}
    check_system(report, {"n1": {**node, "memory_total": 64 * GIB, "memory_available": 60 * GIB}})
    [row] = [row for row in report.rows if row.check == "object store"]
    assert row.status == status, row
    if status == WARN:
        assert "on disk" in row.value and "object-store-memory" in row.fix
