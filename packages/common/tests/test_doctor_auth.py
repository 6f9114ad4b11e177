"""The doctor's authentication row, from what each node reports and where the dashboard listens."""

from __future__ import annotations

import pytest

from raytrain_common.doctor import FAIL, OK, WARN, Report, Shape, check_auth

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
