"""A side-channel address is vouched for by a secret holder: any change to what the proof covers, another
secret, or an ended term is refused, before anything is connected to."""

from __future__ import annotations

import pytest

from kvbridge.errors import AuthenticationError
from kvbridge.transfer.address_proof import CLOCK_SKEW_S, SideChannelAddress, check_address, prove_address

SECRET = b"s" * 32
ADDRESS = SideChannelAddress("prefill-0", "inc-1", "127.0.0.1", 5600)
EXPIRES_AT = 1_000.0


def test_the_proof_checks_until_its_term_and_the_skew_end():
    mac = prove_address(SECRET, ADDRESS, EXPIRES_AT)
    check_address(SECRET, ADDRESS, EXPIRES_AT, mac, now_wall=EXPIRES_AT + CLOCK_SKEW_S)
    with pytest.raises(AuthenticationError, match="ended"):
        check_address(SECRET, ADDRESS, EXPIRES_AT, mac, now_wall=EXPIRES_AT + CLOCK_SKEW_S + 1)


@pytest.mark.parametrize("changed", [
    ADDRESS._replace(port=5601), ADDRESS._replace(host="127.0.0.2"), ADDRESS._replace(engine_id="prefill-1"),
    ADDRESS._replace(incarnation="inc-2"), ADDRESS._replace(engine_id="prefill-0i", incarnation="nc-1"),
])  # fmt: skip
def test_another_address_is_refused(changed):
    mac = prove_address(SECRET, ADDRESS, EXPIRES_AT)
    with pytest.raises(AuthenticationError, match="not vouched for"):
        check_address(SECRET, changed, EXPIRES_AT, mac, now_wall=0.0)


def test_another_secret_a_longer_term_or_no_proof_is_refused():
    mac = prove_address(SECRET, ADDRESS, EXPIRES_AT)
    with pytest.raises(AuthenticationError, match="KVBRIDGE_SIDE_CHANNEL_SECRET"):
        check_address(b"t" * 32, ADDRESS, EXPIRES_AT, mac, now_wall=0.0)
    with pytest.raises(AuthenticationError, match="not vouched for"):
        check_address(SECRET, ADDRESS, EXPIRES_AT + 3600, mac, now_wall=0.0)
    with pytest.raises(AuthenticationError, match="no proof"):
        check_address(SECRET, ADDRESS, EXPIRES_AT, "", now_wall=0.0)
    with pytest.raises(AuthenticationError, match="not vouched for"):
        check_address(SECRET, ADDRESS, EXPIRES_AT, "é" * 64, now_wall=0.0)
