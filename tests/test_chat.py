"""Multi-turn reuse: a kept cache gives the tokens of re-prefilling the whole conversation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.chat import ChatSession, Turn

pytestmark = pytest.mark.cpu_only("not yet converted to the `device` fixture (issue 47 follow-up)")


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model


def reference_replies(model, turns, max_new, stop=()):
    """Each reply from `generate` on the whole conversation so far, from an empty cache."""
    history, replies = [], []
    for t in turns:
        ids = torch.tensor([history + t])
        reply = kvlib.generate(model, ids, max_new_tokens=max_new, stop=stop)[0, ids.shape[1]:].tolist()
        history += t + reply
        replies.append(reply)
    return replies


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    max_new=st.integers(1, 6),
    use_stop=st.booleans(),
    dynamic=st.booleans(),
)
def test_reuse_and_re_prefill_give_generates_tokens(tiny, lengths, max_new, use_stop, dynamic):
    turns = [[(3 * i + 7 * j) % 50 for j in range(n)] for i, n in enumerate(lengths)]
    stop = (7, 11) if use_stop else ()
    want = reference_replies(tiny, turns, max_new, stop)
    for reuse in (True, False):
        cache = kvlib.DynamicCache(tiny.config.n_layer) if dynamic else None
        chat = ChatSession(tiny, reuse=reuse, cache=cache)
        assert [chat.say(t, max_new, stop=stop) for t in turns] == want
        assert chat.history == [x for t, r in zip(turns, want) for x in t + r]


def test_reuse_prefills_each_turn_once(tiny):
    """Turn t re-prefills everything said before it without reuse; with reuse, only its own
    tokens and the one token the last reply sampled but never fed."""
    turns = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]]
    reuse, again = ChatSession(tiny), ChatSession(tiny, reuse=False)
    for t in turns:
        reuse.say(t, 4)
        again.say(t, 4)
    assert [x.prefilled for x in reuse.turns] == [5, 3 + 1, 4 + 1, 2 + 1]
    held = [0, 5 + 4, 5 + 4 + 3 + 4, 5 + 4 + 3 + 4 + 4 + 4]  # the conversation before each turn
    assert [x.reused for x in reuse.turns] == [0] + [h - 1 for h in held[1:]]  # all but the unfed token
    assert [x.prefilled for x in again.turns] == [h + len(t) for h, t in zip(held, turns)]
    assert all(x.reused == 0 for x in again.turns)
    assert reuse.cache.seq_len == len(reuse.history) - 1 and reuse.unfed == reuse.history[-1:]
    assert reuse.prefilled == 5 + 4 + 5 + 3 and again.prefilled == 5 + 12 + 20 + 26
    assert isinstance(reuse.turns[0], Turn) and "4 turns" in repr(reuse)


def test_forgetting_the_unfed_token_changes_the_reply(tiny):
    """The bug the docstring warns of: feed only the new turn, and the reply's last token is
    missing from what the model reads. Against the reference, the replies differ."""
    turns = [[1, 2, 3, 4, 5], [6, 7, 8]]
    want = reference_replies(tiny, turns, 6)
    cache = kvlib.DynamicCache(tiny.config.n_layer)
    first = list(kvlib.stream(tiny, turns[0], 6, cache=cache))
    second = list(kvlib.stream(tiny, turns[1], 6, cache=cache))  # the last token of `first` never fed
    assert first == want[0] and second != want[1]


@pytest.mark.smollm2
def test_chat_on_smollm2_reuse_equals_re_prefill(smollm2):
    """Three turns through SmolLM2's chat template, each reply closed as the template closes
    it: identical replies, and reuse prefills each turn once."""
    model, tok = smollm2
    end, newline = tok.encode("<|im_end|>"), tok.encode("\n")
    questions = ["What is the capital of France?", "And of Italy?", "Which is larger?"]
    chats = ChatSession(model), ChatSession(model, reuse=False)
    messages, reply = [], None
    for q in questions:
        before = tok.apply_chat_template(messages, add_generation_prompt=False) if messages else []
        messages.append({"role": "user", "content": q})
        turn = tok.apply_chat_template(messages)[len(before):]
        if reply is not None:
            turn = (end if reply[-1:] != end else []) + newline + turn
        replies = [c.say(turn, 12, stop=end) for c in chats]
        assert replies[0] == replies[1]
        reply = replies[0]
        messages.append({"role": "assistant", "content": tok.decode([t for t in reply if t not in end])})
    assert chats[0].prefilled < chats[1].prefilled


def test_bad_input_is_refused(tiny):
    with pytest.raises(TypeError, match="needs a kvlib Transformer"):
        ChatSession("model")
    with pytest.raises(TypeError, match="reuse must be True or False"):
        ChatSession(tiny, reuse=1)
    with pytest.raises(TypeError, match="cache must be a kvlib Cache"):
        ChatSession(tiny, cache=object())
    full = kvlib.DynamicCache(tiny.config.n_layer)
    kvlib.prefill(tiny, torch.tensor([[1, 2]]), full)
    with pytest.raises(ValueError, match="needs an empty cache; this one has seen 2 tokens"):
        ChatSession(tiny, cache=full)
    chat = ChatSession(tiny)
    with pytest.raises(ValueError, match="at least one token"):
        chat.say([], 3)
    with pytest.raises(IndexError, match=r"\[0, 50\), got min 1 max 50"):
        chat.say([1, 50], 3)
    with pytest.raises(TypeError, match="token ids are integers"):
        chat.say([1, 2.0], 3)


def test_a_turn_that_fails_midway_leaves_the_next_turn_exact(tiny, monkeypatch):
    """The cache held part of the failed turn, the history none of it: the session starts the
    cache over, and the next turn re-prefills the history and gives generate's reply."""
    turns = [[1, 2, 3, 4, 5], [6, 7, 8]]
    chat = ChatSession(tiny)
    first = chat.say(turns[0], 4)
    real, calls = type(tiny).forward, []

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the failed turn's prefill and first decode step ran
            raise KeyboardInterrupt("interrupted mid-reply")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(tiny), "forward", flaky)
    with pytest.raises(KeyboardInterrupt):
        chat.say([9, 10], 4)
    monkeypatch.undo()
    assert chat.history == turns[0] + first and chat.cache.seq_len == 0
    want = reference_replies(tiny, turns, 4)
    assert chat.say(turns[1], 4) == want[1]
