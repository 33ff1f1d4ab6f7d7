"""Signed lease grants (transfer/grants.py): only the owner's key makes one, and one names exactly one
lease of one owner instance, for its term."""

from __future__ import annotations

import base64

import pytest

from kvbridge.transfer import messages as m
from kvbridge.transfer.grants import MAX_GRANT_CHARS, GrantError, GrantSigner, check_grant, open_grant

LEASE = m.LeaseRef(req_id="r1", token="t" * 64, block_ids=[4, 5, 9], block_hash="ab" * 16)
DIGEST = m.KVDigest(alg="xxh3-64", values=[1, 2, 2**64 - 1])


def signed(now: float = 1000.0, lease_s: float = 30.0, signer: GrantSigner | None = None) -> tuple[GrantSigner, str]:
    signer = signer or GrantSigner(wall_clock=lambda: now)
    return signer, signer.sign(LEASE, "inc-1", DIGEST, lease_s)


def test_a_grant_opens_with_the_owners_key_and_holds_what_was_signed():
    signer, text = signed()
    grant = open_grant(signer.key, text)
    assert grant.lease == LEASE and grant.digest == DIGEST and grant.incarnation == "inc-1"
    assert grant.expires_at == 1030.0
    check_grant(grant, LEASE, "inc-1", now_wall=1020.0)


def test_another_key_or_any_changed_byte_is_refused():
    signer, text = signed()
    with pytest.raises(GrantError, match="not signed"):
        open_grant(GrantSigner().key, text)
    raw = base64.urlsafe_b64decode(text)
    for i in (0, 31, 32, len(raw) - 1):  # the MAC, and the body's first and last bytes
        bad = bytearray(raw)
        bad[i] ^= 0x80
        with pytest.raises(GrantError, match="not signed"):
            open_grant(signer.key, base64.urlsafe_b64encode(bytes(bad)).decode())
    for text_ in ("", "@@@", "a" * 10, base64.urlsafe_b64encode(b"x" * 31).decode()):
        with pytest.raises(GrantError):
            open_grant(signer.key, text_)
    with pytest.raises(GrantError, match="larger"):
        open_grant(signer.key, "A" * (MAX_GRANT_CHARS + 4))
    with pytest.raises(GrantError, match="no grant key"):
        open_grant(b"", text)


@pytest.mark.parametrize(
    "lease, incarnation, now, reason",
    [
        (m.LeaseRef(req_id="r1", token="t" * 64, block_ids=[4, 5, 8], block_hash="ab" * 16), "inc-1", 1000.0, "another lease"),
        (m.LeaseRef(req_id="r1", token="u" * 64, block_ids=[4, 5, 9], block_hash="ab" * 16), "inc-1", 1000.0, "another lease"),
        (m.LeaseRef(req_id="r2", token="t" * 64, block_ids=[4, 5, 9], block_hash="ab" * 16), "inc-1", 1000.0, "another lease"),
        (LEASE, "inc-2", 1000.0, "another instance"),
        (LEASE, "inc-1", 1029.5, "term ended"),  # within the allowed clock skew of the end
        (LEASE, "inc-1", 5000.0, "term ended"),
    ],
)
def test_a_grant_is_for_one_lease_of_one_instance_within_its_term(lease, incarnation, now, reason):
    signer, text = signed()
    with pytest.raises(GrantError, match=reason):
        check_grant(open_grant(signer.key, text), lease, incarnation, now_wall=now)


def test_a_short_key_is_refused():
    with pytest.raises(ValueError):
        GrantSigner(key=b"k" * 16)
