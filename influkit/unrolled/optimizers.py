"""Optimizer update rules as pure functions of (params, state, grads, lr, step), so reverse mode through them is exact.

Each rule returns new tensors and never updates in place; training, replay and the metagradient's reverse pass all
call the same function, so a replay repeats the recorded arithmetic operation for operation. ``params``,
``grads`` and every state slot are dicts name → tensor over the trained parameters; ``step`` counts from 1;
``lr`` is the step's learning rate (a schedule is recorded step by step). Each rule calls the very kernels of
``torch.optim``'s single-tensor path (``foreach=False``: ``add(alpha=)``, ``lerp``, ``addcmul``, ``addcdiv``) in its
order, out of place, so a run of ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` is repeated bit for bit
(``tests/test_unrolled_torch_optim.py``). :class:`Groups` is a ``torch.optim`` optimizer's parameter groups, one rule
each, with gradient clipping by the global norm (``torch.nn.utils.clip_grad_norm_``'s arithmetic).

Each rule's ``pullback`` is the vector-Jacobian product of its ``update`` written out by hand — what autograd would
give through the update, in a few fused elementwise operations per tensor instead of a recorded graph — so the
metagradient's reverse pass (:mod:`.metagradient`) takes the update forward without autograd and pulls it back
in closed form: given the cotangents (θ̄', s̄') of the outputs it returns (θ̄, s̄, ḡ) on the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError, NotReplayable

Tensors = dict[str, torch.Tensor]
State = dict[str, Tensors]


def _safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """√x with the value of ``torch.sqrt`` and derivative 0 (not ∞) where x = 0.

    Adam's second moment v is exactly 0 only for a coordinate whose gradient was exactly 0 at every step so far;
    there √v is not differentiable and 0 is its symmetric subgradient (∞·0 would turn the adjoint into NaN).
    """
    positive = x > 0
    return torch.sqrt(torch.where(positive, x, torch.ones_like(x))) * positive


@dataclass(frozen=True)
class SGD:
    """Stochastic gradient descent with heavy-ball momentum μ, dampening τ and coupled weight decay λ
    (``torch.optim.SGD``).

    d = ±g + λθ (− under ``maximize``);  b ← d at step 1, else μ b + (1 − τ) d;  θ ← θ − lr·(d + μ b if nesterov
    else b).
    """

    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    dampening: float = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        _check(self.lr >= 0, f"lr must be ≥ 0, got {self.lr!r}")
        _check(0 <= self.momentum < 1, f"momentum must lie in [0, 1), got {self.momentum!r}")
        _check(self.weight_decay >= 0, f"weight_decay must be ≥ 0, got {self.weight_decay!r}")
        _check(not self.nesterov or (self.momentum > 0 and self.dampening == 0),
               "nesterov needs momentum > 0 and dampening = 0")

    def init(self, params: Tensors) -> State:
        """The state before the first step: the momentum buffer b = 0 (none without momentum)."""
        return {"momentum": {n: torch.zeros_like(p) for n, p in params.items()}} if self.momentum else {}

    def update(self, params: Tensors, state: State, grads: Tensors, lr: float, step: int) -> tuple[Tensors, State]:
        """(θ', state') after one step."""
        new_params, buffers = {}, {}
        for n, p in params.items():
            d = -grads[n] if self.maximize else grads[n]
            if self.weight_decay:
                d = torch.add(d, p, alpha=self.weight_decay)
            if self.momentum:
                buffers[n] = d if step == 1 else torch.add(state["momentum"][n] * self.momentum, d,
                                                           alpha=1 - self.dampening)
                d = torch.add(d, buffers[n], alpha=self.momentum) if self.nesterov else buffers[n]
            new_params[n] = torch.add(p, d, alpha=-lr)
        return new_params, ({"momentum": buffers} if self.momentum else {})

    def pullback(self, params: Tensors, state: State, grads: Tensors, lr: float, step: int, new: tuple[Tensors, State],
                 bar: tuple[Tensors, State]) -> tuple[Tensors, State, Tensors]:
        """(θ̄, s̄, ḡ): the cotangents ``bar`` = (θ̄', s̄') of :meth:`update`'s outputs ``new`` pulled back to its inputs.

        d̄₂ = −lr θ̄';  nesterov: d̄ = d̄₂, b̄' ← b̄' + μ d̄₂, else d̄ = 0, b̄' ← b̄' + d̄₂;  step 1: d̄ += b̄', b̄ = 0,
        else d̄ += (1 − τ) b̄', b̄ = μ b̄';  θ̄ = θ̄' + λ d̄;  ḡ = ±d̄.
        """
        names = list(params)
        params_bar = [bar[0][n] for n in names]
        d_bar = torch._foreach_mul(params_bar, -lr)
        buffers = {}
        if self.momentum:
            b_bar = [bar[1]["momentum"][n] for n in names]
            b_bar = torch._foreach_add(b_bar, d_bar, alpha=self.momentum if self.nesterov else 1.0)
            if step == 1:
                d_bar = torch._foreach_add(d_bar, b_bar) if self.nesterov else b_bar
                buffers = {n: torch.zeros_like(v) for n, v in zip(names, b_bar)}
            else:
                scale = 1 - self.dampening
                d_bar = torch._foreach_add(d_bar, b_bar, alpha=scale) if self.nesterov else \
                    torch._foreach_mul(b_bar, scale)
                buffers = dict(zip(names, torch._foreach_mul(b_bar, self.momentum)))
        if self.weight_decay:
            params_bar = torch._foreach_add(params_bar, d_bar, alpha=self.weight_decay)
        grad_bar = torch._foreach_neg(d_bar) if self.maximize else d_bar
        state_bar = {"momentum": buffers} if self.momentum else {}
        return dict(zip(names, params_bar)), state_bar, dict(zip(names, grad_bar))


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma & Ba) with coupled weight decay λ (an L2 term in the gradient; ``torch.optim.Adam``).

    d = ±g + λθ;  m ← m + (1−β₁)(d − m);  v ← β₂v + (1−β₂)d²;
    θ ← θ − (lr / (1−β₁ᵗ)) · m / (√v / √(1−β₂ᵗ) + ε).

    fused: take the step with torch's fused kernel (``torch._fused_adam_`` / ``_fused_adamw_``, what
    ``torch.optim.Adam(fused=True)`` and transformers' default ``optim="adamw_torch_fused"`` run), on copies, so a
    fused run is repeated bit for bit; the same map, so :meth:`pullback` is the same closed form.
    """

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False
    fused: bool = False

    decoupled = False

    def __post_init__(self) -> None:
        _check(self.lr >= 0, f"lr must be ≥ 0, got {self.lr!r}")
        _check(all(0 <= b < 1 for b in self.betas), f"betas must lie in [0, 1), got {self.betas!r}")
        _check(self.eps > 0, f"eps must be > 0, got {self.eps!r}")
        _check(self.weight_decay >= 0, f"weight_decay must be ≥ 0, got {self.weight_decay!r}")

    def init(self, params: Tensors) -> State:
        """The state before the first step: both moments m = v = 0."""
        return {"m": {n: torch.zeros_like(p) for n, p in params.items()},
                "v": {n: torch.zeros_like(p) for n, p in params.items()}}

    def update(self, params: Tensors, state: State, grads: Tensors, lr: float, step: int) -> tuple[Tensors, State]:
        """(θ', state') after one step (``step`` ≥ 1 enters the bias corrections)."""
        if self.fused:
            return self._fused_update(params, state, grads, lr, step)
        beta1, beta2 = self.betas
        step_size = lr / (1 - beta1**step)
        correction2 = (1 - beta2**step) ** 0.5
        new_params, m_new, v_new = {}, {}, {}
        for n, p in params.items():
            d = -grads[n] if self.maximize else grads[n]
            if self.weight_decay and self.decoupled:
                p = p * (1 - lr * self.weight_decay)
            elif self.weight_decay:
                d = torch.add(d, p, alpha=self.weight_decay)
            m_new[n] = torch.lerp(state["m"][n], d, 1 - beta1)
            v_new[n] = torch.addcmul(state["v"][n] * beta2, d, d, value=1 - beta2)
            new_params[n] = torch.addcdiv(p, m_new[n], _safe_sqrt(v_new[n]) / correction2 + self.eps,
                                          value=-step_size)
        return new_params, {"m": m_new, "v": v_new}

    def _fused_update(self, params: Tensors, state: State, grads: Tensors, lr: float,
                      step: int) -> tuple[Tensors, State]:
        """:meth:`update` by torch's fused kernel on copies of θ, m and v (its step counters at ``step``, as
        ``torch.optim`` increments them before the call)."""
        names = list(params)
        new_params = [params[n].clone() for n in names]
        m_new, v_new = ([state[slot][n].clone() for n in names] for slot in ("m", "v"))
        counters = [torch.tensor(float(step)) for _ in names]
        kernel = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        kernel(new_params, [grads[n] for n in names], m_new, v_new, [], counters, amsgrad=False, lr=lr,
               beta1=self.betas[0], beta2=self.betas[1], weight_decay=self.weight_decay, eps=self.eps,
               maximize=self.maximize, grad_scale=None, found_inf=None)
        return dict(zip(names, new_params)), {"m": dict(zip(names, m_new)), "v": dict(zip(names, v_new))}

    def pullback(self, params: Tensors, state: State, grads: Tensors, lr: float, step: int, new: tuple[Tensors, State],
                 bar: tuple[Tensors, State]) -> tuple[Tensors, State, Tensors]:
        """(θ̄, s̄, ḡ): the cotangents ``bar`` = (θ̄', s̄') of :meth:`update`'s outputs ``new`` pulled back to its inputs.

        With D = √v'/c₂ + ε (c₂ = √(1−β₂ᵗ)) and s = lr/(1−β₁ᵗ): m̄' ← m̄' − s θ̄'/D;
        v̄' ← v̄' + s θ̄'·m'/D² / (2 c₂ √v') (0 where v' = 0, :func:`_safe_sqrt`'s subgradient); m̄ = β₁ m̄';
        v̄ = β₂ v̄';  d̄ = (1−β₁) m̄' + 2(1−β₂) d·v̄';  θ̄ = (1 − lr λ) θ̄' (decoupled) or θ̄' + λ d̄;  ḡ = ±d̄.
        """
        beta1, beta2 = self.betas
        step_size = lr / (1 - beta1**step)
        correction2 = (1 - beta2**step) ** 0.5
        names = list(params)
        params_bar, m_bar, v_bar = ([tree[n] for n in names] for tree in (bar[0], bar[1]["m"], bar[1]["v"]))
        m_new, v_new = [new[1]["m"][n] for n in names], [new[1]["v"][n] for n in names]
        d = [grads[n] for n in names]
        if self.maximize:
            d = torch._foreach_neg(d)
        if self.weight_decay and not self.decoupled:
            d = torch._foreach_add(d, [params[n] for n in names], alpha=self.weight_decay)
        root = torch._foreach_sqrt(v_new)  # _safe_sqrt's values (v' ≥ 0)
        inverse_denom = torch._foreach_div(root, correction2)  # 1/D, built in place on fresh tensors
        torch._foreach_add_(inverse_denom, self.eps)
        torch._foreach_reciprocal_(inverse_denom)
        scaled = torch._foreach_mul(params_bar, inverse_denom)  # θ̄'/D
        m_bar = torch._foreach_add(m_bar, scaled, alpha=-step_size)
        # m'/(D √v'), times sign(√v') = 0 where v' = 0; v̄ gains s θ̄'/D · m'/(D · 2 c₂ √v')
        slope = torch._foreach_sign(root)
        torch._foreach_div_(slope, torch._foreach_clamp_min(root, torch.finfo(root[0].dtype).tiny if root else 0.0))
        torch._foreach_mul_(slope, m_new)
        torch._foreach_mul_(slope, inverse_denom)
        v_bar = torch._foreach_addcmul(v_bar, scaled, slope, value=step_size * 0.5 / correction2)
        d_bar = torch._foreach_mul(m_bar, 1 - beta1)
        torch._foreach_addcmul_(d_bar, d, v_bar, value=2 * (1 - beta2))
        if self.weight_decay and self.decoupled:
            params_bar = torch._foreach_mul(params_bar, 1 - lr * self.weight_decay)
        elif self.weight_decay:
            params_bar = torch._foreach_add(params_bar, d_bar, alpha=self.weight_decay)
        grad_bar = torch._foreach_neg(d_bar) if self.maximize else d_bar
        return (dict(zip(names, params_bar)),
                {"m": dict(zip(names, torch._foreach_mul(m_bar, beta1))),
                 "v": dict(zip(names, torch._foreach_mul(v_bar, beta2)))}, dict(zip(names, grad_bar)))


@dataclass(frozen=True)
class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter; ``torch.optim.AdamW``): θ ← θ(1 − lr·λ) first,
    then Adam's step on the plain gradient g."""

    weight_decay: float = 1e-2
    decoupled = True


Rule = SGD | Adam


@dataclass(frozen=True)
class Groups:
    """A ``torch.optim`` optimizer as pure rules: ``rules[i]`` updates the parameters ``names[i]`` (group i) with
    that group's hyper-parameters; ``update`` takes one learning rate per group (``lr``: a tuple). ``order``: every
    name in the optimizer's order (the order its gradient norm is summed in)."""

    rules: tuple[Rule, ...]
    names: tuple[tuple[str, ...], ...]

    @property
    def order(self) -> list[str]:
        return [n for group in self.names for n in group]

    @property
    def lr(self) -> tuple[float, ...]:
        return tuple(rule.lr for rule in self.rules)

    def init(self, params: Tensors) -> State:
        """The state before the first step: each group's rule's, merged by slot."""
        state: State = {}
        for rule, names in zip(self.rules, self.names):
            for slot, values in rule.init({n: params[n] for n in names}).items():
                state.setdefault(slot, {}).update(values)
        return state

    def update(self, params: Tensors, state: State, grads: Tensors, lr: tuple[float, ...],
               step: int) -> tuple[Tensors, State]:
        """(θ', state') after one step of every group, group i at learning rate lr[i]."""
        new_params: Tensors = {}
        new_state: State = {}
        for rule, names, rate in zip(self.rules, self.names, lr):
            part = {slot: {n: values[n] for n in names} for slot, values in state.items()}
            p, s = rule.update({n: params[n] for n in names}, part, {n: grads[n] for n in names}, rate, step)
            new_params.update(p)
            for slot, values in s.items():
                new_state.setdefault(slot, {}).update(values)
        return {n: new_params[n] for n in params}, new_state

    def pullback(self, params: Tensors, state: State, grads: Tensors, lr: tuple[float, ...], step: int,
                 new: tuple[Tensors, State], bar: tuple[Tensors, State]) -> tuple[Tensors, State, Tensors]:
        """(θ̄, s̄, ḡ): each group's rule's :meth:`~Adam.pullback` on its names, merged as :meth:`update` merges."""
        pick = lambda tree, names: {slot: {n: v[n] for n in names} for slot, v in tree.items()}  # noqa: E731
        out_params: Tensors = {}
        out_state: State = {}
        grad_bars: Tensors = {}
        for rule, names, rate in zip(self.rules, self.names, lr):
            p, s, g = rule.pullback({n: params[n] for n in names}, pick(state, names), {n: grads[n] for n in names},
                                    rate, step, ({n: new[0][n] for n in names}, pick(new[1], names)),
                                    ({n: bar[0][n] for n in names}, pick(bar[1], names)))
            out_params.update(p)
            grad_bars.update(g)
            for slot, values in s.items():
                out_state.setdefault(slot, {}).update(values)
        return {n: out_params[n] for n in params}, out_state, {n: grad_bars[n] for n in params}

    def clip(self, grads: Tensors, max_norm: float, norm_type: float, order: list[str] | None = None) -> Tensors:
        """The gradients scaled as ``clip_grad_norm_(params, max_norm, norm_type)`` scales them: by
        min(max_norm / (‖(‖g_i‖)_i‖ + 10⁻⁶), 1), the per-tensor norms stacked in ``order`` (default the optimizer's:
        the order decides the rounding of the total)."""
        coefficient = self.clip_coefficient(grads, max_norm, norm_type, order)
        return {n: g * coefficient for n, g in grads.items()}

    def clip_pullback(self, grads: Tensors, clipped_bar: Tensors, max_norm: float, norm_type: float,
                      order: list[str] | None = None) -> Tensors:
        """ḡ: the cotangents ``clipped_bar`` of :meth:`clip`'s outputs (a leading dimension q allowed) pulled back to
        its inputs, ḡ_i = c ḡ'_i + (Σ_j ⟨ḡ'_j, g_j⟩) ∂c/∂g_i with c = :meth:`clip_coefficient` (:meth:`clip_slopes`)."""
        names = list(grads)
        coefficient, slopes = self.clip_slopes(grads, max_norm, norm_type, order)
        return dict(zip(names, _scaled_plus_rank_one([clipped_bar[n] for n in names], coefficient,
                                                     [grads[n] for n in names], slopes)))

    def clip_tangent(self, grads: Tensors, tangent: Tensors, max_norm: float, norm_type: float,
                     order: list[str] | None = None) -> Tensors:
        """J δ: the Jacobian of :meth:`clip` at ``grads`` applied to tangents δ (a leading dimension allowed),
        (J δ)_i = c δ_i + (Σ_j ⟨∂c/∂g_j, δ_j⟩) g_i — the transpose of :meth:`clip_pullback`."""
        names = list(grads)
        coefficient, slopes = self.clip_slopes(grads, max_norm, norm_type, order)
        return dict(zip(names, _scaled_plus_rank_one([tangent[n] for n in names], coefficient, slopes,
                                                     [grads[n] for n in names])))

    def clip_slopes(self, grads: Tensors, max_norm: float, norm_type: float,
                    order: list[str] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(c, [∂c/∂g_i]) of :meth:`clip_coefficient` at ``grads``, in their order. For the 2-norm
        ∂c/∂g_i = −[r ≤ 1] r g_i / ((T + 10⁻⁶) T) (T the total norm, r = max_norm / (T + 10⁻⁶); 0 where T = 0, as
        autograd's subgradient); for another norm ∂c/∂g comes from autograd through the coefficient."""
        names = list(grads)
        if norm_type == 2.0:
            ordered = [grads[n] for n in (self.order if order is None else order) if n in grads]  # clip()'s order
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ordered, 2.0)))
            ratio = max_norm / (total + 1e-6)
            factor = torch.where((ratio <= 1) & (total > 0), -ratio / ((total + 1e-6) * total), 0.0)
            return torch.clamp(ratio, max=1.0), torch._foreach_mul([grads[n] for n in names], factor)
        with torch.enable_grad():
            leaves = {n: grads[n].detach().requires_grad_() for n in names}
            coefficient = self.clip_coefficient(leaves, max_norm, norm_type, order)
            slopes = list(torch.autograd.grad(coefficient, list(leaves.values()), allow_unused=True,
                                              materialize_grads=True))
        return coefficient.detach(), slopes

    def clip_coefficient(self, grads: Tensors, max_norm: float, norm_type: float,
                         order: list[str] | None = None) -> torch.Tensor:
        """The factor :meth:`clip` scales every gradient by, min(max_norm / (‖(‖g_i‖)_i‖ + 10⁻⁶), 1), a 0-d tensor."""
        order = [n for n in (self.order if order is None else order) if n in grads]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(grads[n], norm_type) for n in order]),
                                         norm_type)
        return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def from_torch(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> Groups:
    """The pure :class:`Groups` of a ``torch.optim`` SGD, Adam or AdamW (``names``: id(parameter) → model name).

    Refuses (:class:`~influkit.errors.NotReplayable`, every reason of :func:`torch_refusals` in one message) what
    replay cannot repeat bit for bit. A fused Adam / AdamW is replayed by the same fused kernel (:class:`Adam`
    ``fused``)."""
    refuse(torch_refusals(optimizer, names))
    kind = type(optimizer)
    rules, groups = [], []
    for group in optimizer.param_groups:
        values = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
        groups.append(tuple(names[id(p)] for p in group["params"]))
        if kind is torch.optim.SGD:
            rules.append(SGD(lr=float(values["lr"]), momentum=float(values["momentum"]),
                             nesterov=bool(values["nesterov"]), weight_decay=float(values["weight_decay"]),
                             dampening=float(values["dampening"]), maximize=bool(values["maximize"])))
        else:
            decoupled = kind is torch.optim.AdamW or values.get("decoupled_weight_decay", False)
            rules.append((AdamW if decoupled else Adam)(
                lr=float(values["lr"]), betas=tuple(float(b) for b in values["betas"]), eps=float(values["eps"]),
                weight_decay=float(values["weight_decay"]), maximize=bool(values["maximize"]),
                fused=bool(values.get("fused"))))
    return Groups(tuple(rules), tuple(groups))


def torch_refusals(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
    """Every reason replay cannot repeat the ``torch.optim`` optimizer bit for bit, each naming its fix: another
    optimizer class than SGD / Adam / AdamW, amsgrad, capturable / differentiable kernels, a fused SGD, the foreach
    kernels off the CPU (on the CPU they give the single-tensor bits, measured in the tests), a momentum cycled by a
    scheduler, tensor hyper-parameters, a parameter outside the model, or state from earlier steps."""
    kind = type(optimizer)
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return [f"influkit replays torch.optim.SGD, Adam and AdamW exactly; {kind.__module__}.{kind.__qualname__} is "
                "not one of them. Train with one of those three (any lr_scheduler, parameter groups, clipping)."]
    reasons = []
    if optimizer.state:
        reasons.append("the optimizer has state from earlier steps; start watching with a fresh optimizer, before its "
                       "first step().")
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "capturable", "differentiable") + (("fused",) if kind is torch.optim.SGD else ()):
            if group.get(flag):
                reasons.append(f"param group {i} sets {flag}=True, which replay does not repeat; construct the "
                               f"optimizer with {flag}=False.")
        if "max_momentum" in group:
            reasons.append(f"param group {i} has its momentum cycled by a scheduler (OneCycleLR / CyclicLR "
                           "cycle_momentum=True), which replay does not record; construct the scheduler with "
                           "cycle_momentum=False.")
        on_cpu = all(p.device.type == "cpu" for p in group["params"])
        if not on_cpu and group.get("foreach") is not False and not group.get("fused"):
            reasons.append(f"param group {i} would take torch.optim's multi-tensor (foreach) kernels on "
                           f"{group['params'][0].device.type}, which replay's single-tensor kernels are not checked "
                           "to match bit for bit there; construct the optimizer with foreach=False (or fused=True).")
        bad = [k for k, v in group.items() if k not in ("params", "initial_lr") and (torch.is_tensor(v) or (
            isinstance(v, tuple) and any(torch.is_tensor(b) for b in v)))]
        if bad:
            reasons.append(f"param group {i} has tensor hyper-parameters {bad}; give them as Python floats.")
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            reasons.append(f"param group {i} holds {len(unknown)} tensors that are not parameters of the watched "
                           "model; watch the model that owns every optimized parameter.")
    return reasons


def refuse(reasons: list[str]) -> None:
    """Raise one :class:`~influkit.errors.NotReplayable` listing every reason (nothing when there is none), so a
    configuration learns all it must change from one run."""
    if len(reasons) == 1:
        raise NotReplayable(reasons[0])
    if reasons:
        raise NotReplayable(f"{len(reasons)} things keep this run from being replayed; change them all before "
                            "training:\n" + "\n".join(f"  {i}. {r}" for i, r in enumerate(reasons, 1)))


def torch_state(optimizer: torch.optim.Optimizer, groups: Groups, names: dict[int, str]) -> State:
    """The optimizer's current state in the pure rules' slots (copies): SGD's momentum buffers, Adam's m and v."""
    state: State = {}
    slots = {"momentum_buffer": "momentum", "exp_avg": "m", "exp_avg_sq": "v"}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, slot in slots.items():
                value = optimizer.state.get(p, {}).get(key)
                if value is not None:
                    state.setdefault(slot, {})[names[id(p)]] = value.detach().clone()
    return state


def _scaled_plus_rank_one(x: list[torch.Tensor], c: torch.Tensor, u: list[torch.Tensor],
                          w: list[torch.Tensor]) -> list[torch.Tensor]:
    """c x_i + (Σ_j ⟨x_j, u_j⟩) w_i for tensors x_i that may carry a leading dimension (u, w without it): the
    clipping's Jacobian (u = ∂c/∂g, w = g) and its transpose (u = g, w = ∂c/∂g). Dot products per tensor, summed: no
    concatenated copy."""
    lead = x[0].shape[:x[0].dim() - u[0].dim()]
    along = sum(t.reshape(*lead, -1) @ o.reshape(-1) for t, o in zip(x, u))
    out = torch._foreach_mul(x, c)
    torch._foreach_addcmul_(out, [along.reshape(*lead, *[1] * v.dim()) for v in w], w)
    return out


Optimizer = SGD | Adam | Groups


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InputError(message + "; fix the optimizer's hyper-parameters.")
