"""swarm.allowed_peers: peer ids and files of them, and clear errors for anything else."""

import pytest

from p2p_diloco.errors import SwarmError
from p2p_diloco.swarm.allowlist import resolve_allowed_peers

pytestmark = pytest.mark.unit
A = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
B = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"


def test_empty_is_an_open_swarm():
    assert resolve_allowed_peers([]) is None
    assert resolve_allowed_peers(["  "]) is None


def test_ids_and_files_with_comments(tmp_path):
    members = tmp_path / "members.txt"
    members.write_text(f"# the run's members\n{A}  # alice\n\n")
    assert resolve_allowed_peers([str(members), B]) == {A, B}


@pytest.mark.parametrize("entry, needle", [("abc", "'abc' is neither a file nor a peer id"),
                                           ("0OIl", "is neither a file nor a peer id")])
def test_bad_entries_are_clear_errors(entry, needle):
    with pytest.raises(SwarmError, match=needle):
        resolve_allowed_peers([entry])


def test_a_file_of_nobody_is_an_error(tmp_path):
    empty = tmp_path / "members.txt"
    empty.write_text("# nobody yet\n")
    with pytest.raises(SwarmError, match="lists no peer id"):
        resolve_allowed_peers([str(empty)])
