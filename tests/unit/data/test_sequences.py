"""Chat-template encoding, padding and masks (opd/data/sequences.py) and BatchedDataDict."""

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import build_token_mask, encode_prompt, encode_response, pack_sequences
from opd.models.tiny import build_tiny_tokenizer


def test_prompt_plus_response_equals_the_rendered_conversation_up_to_eos():
    tokenizer = build_tiny_tokenizer()
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    response = {"role": "assistant", "content": "\\boxed{5}"}
    prompt_ids = encode_prompt(tokenizer, prompt)
    response_ids = encode_response(tokenizer, prompt, response)
    full_text = tokenizer.apply_chat_template(prompt + [response], tokenize=False)
    full_ids = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    assert prompt_ids + response_ids == full_ids[: len(prompt_ids) + len(response_ids)]
    assert response_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.eos_token_id not in response_ids[:-1]
    assert tokenizer.decode(response_ids[:-1]) == "\\boxed{5}"
    assert len(full_ids) == len(prompt_ids) + len(response_ids) + 1  # ChatML's "\n" after EOS is dropped


def test_pack_sequences_right_pads_and_masks_only_responses():
    batch = pack_sequences([[1, 2, 3, 4, 5], [6, 7, 8]], [3, 2], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]
    assert batch["token_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]]
    everything = pack_sequences([[1, 2, 3, 4, 5], [6, 7, 8]], [3, 2], pad_token_id=0, mask_prompt_tokens=False)
    assert everything["token_mask"].tolist() == [[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]]


def test_empty_response_has_no_loss_tokens():
    mask = build_token_mask(torch.tensor([4, 6]), torch.tensor([4, 3]), 6, mask_prompt_tokens=True)
    assert mask[0].sum() == 0 and mask[1].tolist() == [0, 0, 0, 1, 1, 1]


def test_batched_data_dict_helpers_keep_rows_aligned():
    batch = BatchedDataDict(ids=torch.arange(6).view(3, 2), names=["a", "b", "c"])
    assert batch.size == 3
    repeated = batch.repeat_interleave(2)
    assert repeated["names"] == ["a", "a", "b", "b", "c", "c"]
    assert repeated["ids"][:, 0].tolist() == [0, 0, 2, 2, 4, 4]
    micro = list(batch.make_microbatches(2))
    assert [m.size for m in micro] == [2, 1] and micro[1]["names"] == ["c"]
    picked = batch.select_indices([2, 0])
    assert picked["names"] == ["c", "a"] and picked["ids"][:, 1].tolist() == [5, 1]
    joined = BatchedDataDict.concat(
        [BatchedDataDict(x=torch.ones(1, 2)), BatchedDataDict(x=torch.ones(1, 4))], pad_values={"x": -1}
    )
    assert joined["x"].tolist() == [[1, 1, -1, -1], [1, 1, 1, 1]]
