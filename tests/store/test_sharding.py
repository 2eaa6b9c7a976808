"""A sharded tensor assembled from its ranks' pieces (store/sharding.py), and the manifest's description of
the pieces checked and kept through its JSON."""

from __future__ import annotations

import pytest
import torch

from replay.errors import StoreError
from replay.store.sharding import Piece, ShardedTensor, Sharding, assemble


def test_pieces_cut_along_a_dimension_assemble_in_offset_order():
    whole = torch.arange(7 * 5.0).view(7, 5)
    spec = ShardedTensor(shape=[7, 5], dim=0, pieces=[Piece(4, 3), Piece(0, 4), Piece(7, 0)])   # ranks 0, 1, 2
    assert torch.equal(assemble(spec, [whole[4:], whole[:4], None]), whole)


def test_flat_partitions_with_padding_assemble_to_the_shape():
    whole = torch.arange(10.0).view(2, 5)
    flat = torch.cat([whole.reshape(-1), torch.zeros(2)])   # two partitions of 6, the last one padded
    spec = ShardedTensor(shape=[2, 5], dim=None, pieces=[Piece(0, 6), Piece(6, 6)])
    spec.check("w")
    assert torch.equal(assemble(spec, [flat[:6], flat[6:]]), whole)


@pytest.mark.parametrize("pieces, message", [
    ([Piece(0, 3), Piece(4, 3)], "leaves a gap or overlap at 3"),
    ([Piece(0, 4), Piece(3, 4)], "leaves a gap or overlap at 4"),
    ([Piece(0, 3), Piece(3, 3)], "covers 6 of its 7"),
])
def test_pieces_that_do_not_tile_the_tensor_are_refused(pieces, message):
    with pytest.raises(StoreError, match=message):
        ShardedTensor(shape=[7, 5], dim=0, pieces=pieces).check("w")


def test_a_sharding_survives_its_json():
    sharding = Sharding("fsdp2", {"w": ShardedTensor([7, 5], 0, [Piece(0, 4), Piece(4, 3)])}, {"mesh": [2]})
    assert Sharding.from_dict(sharding.to_dict()) == sharding
