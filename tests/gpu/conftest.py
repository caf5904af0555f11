import pytest


@pytest.fixture(scope="session")
def flash_width_ckpt(tmp_path_factory):
    """A 2-layer flash-width checkpoint (the release's widths: CSA + HCA layers, 256 experts; the tiny
    preset's K is too short for the split-K GEMMs and the tiles the real widths pick)."""
    from dsv4.checkpoint.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("fw2"), preset="flash-width", layers=2, device="cuda",
                            progress=False)
