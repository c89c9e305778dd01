import pytest

from gyre_slurm.engines.embedded import check_loopback
from gyre_slurm.errors import UserError


@pytest.mark.parametrize("host", ["127.0.10.3", "::1", "10.12.0.7"])
def test_a_server_binds_to_one_node_address(host):
    check_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "node1", "", "224.0.0.1"])
def test_wildcards_and_names_are_refused(host):
    with pytest.raises(UserError, match="binds to one node's own IP address"):
        check_loopback(host)
