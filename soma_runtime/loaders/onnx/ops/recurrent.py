"""ONNX's recurrent layers (RNN, GRU, LSTM), unrolled over their known sequence length: the input's
products with W for every step in one matmul, then per step the recurrent product with R and the
gates, as the ONNX operator definitions write them (gate orders i-o-f-c and z-r-h). Sequences shorter
than the input (sequence_lens, from the data too) are masked step by step. How the inputs and the states
meet the weights is the frame's parameter: in f32 here, quantized for contrib.py's DynamicQuantizeLSTM."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from soma_runtime.dtypes import dtype
from soma_runtime.loaders.onnx.ops.control import stacked, step_count
from soma_runtime.loaders.onnx.ops.elementwise import scalar
from soma_runtime.loaders.onnx.ops.layout import reshape_to
from soma_runtime.loaders.onnx.ops.table import onnx_op

ACTIVATIONS = {"Sigmoid": "sigmoid", "Tanh": "tanh", "Relu": "relu"}


@dataclass
class Layer:
    """One direction's view of a recurrent node: its weights, biases, peepholes and initial states."""
    x_w: object             # X @ W.T + Wb + Rb for every step: [seq, batch, gates * hidden]
    r: object | None        # [gates * hidden, hidden] in f32 (None where R is quantized)
    times_r: Callable       # (cv, h) -> h @ R.T: [batch, gates * hidden]
    r_bias: object | None   # GRU with linear_before_reset: Rb added to R's product (the h gate's scaled by r)
    peepholes: object | None
    states: list


@dataclass
class FloatProducts:
    """A recurrent node's products in f32, W [directions, gates * hidden, input] and R [directions,
    gates * hidden, hidden] as ONNX writes them."""
    w: object
    r: object

    def inputs(self, cv, x, d: int):
        """x [rows, input] @ W[d].T."""
        return cv.emit("matmul", x, part(cv, self.w, d), transpose_b=True)

    def states(self, cv, d: int) -> tuple:
        """R[d] and the function giving h @ R[d].T."""
        rd = part(cv, self.r, d)
        return rd, lambda cv, h: cv.emit("matmul", h, rd, transpose_b=True)


def part(cv, x, index: int, axis: int = 0):
    """x's slice `index` along `axis`, the axis dropped (a direction of W, R, B)."""
    return cv.emit("take", x, np.array(index, np.int64), axis=axis)


def columns(cv, x, i: int, hidden: int):
    """Gate i of a [..., gates * hidden] tensor."""
    return cv.emit("slice", x, axis=-1 % cv.meta(x).ndim, start=i * hidden, stop=(i + 1) * hidden)


def activation(cv, name: str, x):
    if name not in ACTIVATIONS:
        raise cv.unsupported(f"activation {name} is not supported (Sigmoid, Tanh and Relu are)")
    return cv.emit(ACTIVATIONS[name], x)


def recurrent(cv, n, gates: int, n_states: int, step, products=None):
    """The frame every recurrent op shares: layout, directions, initial states, the unrolled steps and the
    outputs Y [seq, directions, batch, hidden] and each final state [directions, batch, hidden]. `step(cv,
    layer, x_w_t, states, acts, hidden) -> states` computes one step of one direction (states[0] is H);
    `products` (FloatProducts of W and R unless given) how the inputs and states meet the weights."""
    x, b = n.input(0), n.input(3)
    products = products or FloatProducts(n.input(1), n.input(2))
    lengths = n.input(4)
    layout = n.attr("layout", 0)
    if layout:
        x = cv.emit("permute", x, perm=(1, 0, 2))
    seq, batch, _ = cv.meta(x).shape
    seq = step_count(cv, seq)
    if isinstance(lengths, np.ndarray) and (lengths == seq).all():
        lengths = None
    running = [None] * seq if lengths is None else [running_at(cv, lengths, t, batch) for t in range(seq)]
    hidden = int(n.attr("hidden_size"))
    direction = n.attr("direction", "forward")
    directions = ["forward", "reverse"] if direction == "bidirectional" else [direction]
    names = n.attr("activations") or []
    per_direction = len(names) // len(directions) if names else 0
    if n.attr("clip") is not None or n.attr("activation_alpha") or n.attr("activation_beta"):
        raise cv.unsupported("clipped cells and parametrized activations are not supported")
    initial = [n.input(5 + i) for i in range(n_states)]
    rows = reshape_to(cv, x, (seq * batch, cv.meta(x).shape[2]))
    ys, finals = [], [[] for _ in range(n_states)]
    for d, way in enumerate(directions):
        x_w = products.inputs(cv, rows, d)
        rd, times_r = products.states(cv, d)
        r_bias = None
        if b is not None:
            bd = part(cv, b, d)
            wb, rb = columns(cv, bd, 0, gates * hidden), columns(cv, bd, 1, gates * hidden)
            if n.op_type == "GRU" and n.attr("linear_before_reset", 0):
                r_bias = rb                               # added to R's product before the reset gate scales it
                x_w = cv.emit("add", x_w, wb)
            else:
                x_w = cv.emit("add", x_w, cv.emit("add", wb, rb))
        states = [part(cv, s, d) if s is not None else cv.emit("expand", scalar(cv, 0, x), shape=(batch, hidden))
                  for s in initial]
        peepholes = n.input(7)
        layer = Layer(reshape_to(cv, x_w, (seq, batch, gates * hidden)), rd, times_r, r_bias,
                      None if peepholes is None else part(cv, peepholes, d), states)
        acts = names[d * per_direction:(d + 1) * per_direction] if names else None
        outputs = [None] * seq
        order = range(seq) if way == "forward" else range(seq - 1, -1, -1)
        for t in order:
            states = step(cv, layer, part(cv, layer.x_w, t), layer.states, acts, hidden)
            if running[t] is not None:          # past its length a sequence keeps its state and outputs zeros
                outputs[t] = cv.emit("where", running[t], states[0], scalar(cv, 0, states[0]))
                states = [cv.emit("where", running[t], new, old) for new, old in zip(states, layer.states)]
            else:
                outputs[t] = states[0]
            layer.states = states
        ys.append(stacked(cv, outputs, 0))
        for i, s in enumerate(layer.states):
            finals[i].append(s)
    y = stacked(cv, ys, 1)                              # [seq, directions, batch, hidden]
    if layout:
        y = cv.emit("permute", y, perm=(2, 0, 1, 3))
    finals = [stacked(cv, f, 0) for f in finals]        # [directions, batch, hidden]
    if layout:
        finals = [cv.emit("permute", f, perm=(1, 0, 2)) for f in finals]
    return [y, *finals]


def running_at(cv, lengths, t: int, batch):
    """[batch, 1]: whether step t is within each sequence's length (sequence_lens, known or data). A reverse
    pass that skips the steps past a length starts, as ONNX's does, at that sequence's last step."""
    inside = cv.emit("less", np.array(t, dtype(cv.meta(lengths).dtype).numpy), lengths)
    return reshape_to(cv, inside, (batch, 1))


def rnn_step(cv, layer, x_w, states, acts, hidden):
    (h,) = states
    pre = cv.emit("add", x_w, layer.times_r(cv, h))
    return [activation(cv, (acts or ["Tanh"])[0], pre)]


def gru_step(cv, layer, x_w, states, acts, hidden):
    (h,) = states
    f, g = (acts or ["Sigmoid", "Tanh"])[:2]
    h_r = layer.times_r(cv, h)                                        # [batch, 3 * hidden]
    if layer.r_bias is not None:                                      # linear_before_reset: Rb is in R's product
        h_r = cv.emit("add", h_r, layer.r_bias)
    z = activation(cv, f, cv.emit("add", columns(cv, x_w, 0, hidden), columns(cv, h_r, 0, hidden)))
    r = activation(cv, f, cv.emit("add", columns(cv, x_w, 1, hidden), columns(cv, h_r, 1, hidden)))
    if layer.r_bias is not None:
        candidate = cv.emit("add", columns(cv, x_w, 2, hidden), cv.emit("mul", r, columns(cv, h_r, 2, hidden)))
    else:
        rh_weight = cv.emit("slice", layer.r, axis=0, start=2 * hidden, stop=3 * hidden)
        candidate = cv.emit("add", columns(cv, x_w, 2, hidden),
                            cv.emit("matmul", cv.emit("mul", r, h), rh_weight, transpose_b=True))
    h_new = activation(cv, g, candidate)
    one = scalar(cv, 1, h)
    return [cv.emit("add", cv.emit("mul", cv.emit("sub", one, z), h_new), cv.emit("mul", z, h))]


def lstm_step(cv, layer, x_w, states, acts, hidden):
    h, c = states
    f, g, out = (acts or ["Sigmoid", "Tanh", "Tanh"])[:3]
    pre = cv.emit("add", x_w, layer.times_r(cv, h))
    gate = [columns(cv, pre, i, hidden) for i in range(4)]            # i, o, f, c
    if layer.peepholes is not None:
        p = [columns(cv, layer.peepholes, i, hidden) for i in range(3)]   # i, o, f
        gate[0] = cv.emit("add", gate[0], cv.emit("mul", p[0], c))
        gate[2] = cv.emit("add", gate[2], cv.emit("mul", p[2], c))
    i_t, f_t, c_hat = activation(cv, f, gate[0]), activation(cv, f, gate[2]), activation(cv, g, gate[3])
    c_new = cv.emit("add", cv.emit("mul", f_t, c), cv.emit("mul", i_t, c_hat))
    if layer.peepholes is not None:
        gate[1] = cv.emit("add", gate[1], cv.emit("mul", p[1], c_new))
    o_t = activation(cv, f, gate[1])
    return [cv.emit("mul", o_t, activation(cv, out, c_new)), c_new]


@onnx_op("RNN")
def rnn(cv, n):
    return recurrent(cv, n, 1, 1, rnn_step)


@onnx_op("GRU")
def gru(cv, n):
    return recurrent(cv, n, 3, 1, gru_step)


@onnx_op("LSTM")
def lstm(cv, n, products=None):
    """ONNX's LSTM (and, given its products, another op of the same inputs and attributes)."""
    if n.attr("input_forget", 0):
        raise cv.unsupported("input_forget (coupled input and forget gates) is not supported")
    return recurrent(cv, n, 4, 2, lstm_step, products)
