// Training through tdist's C ABI from Rust, as tch-rs would call it: a
// hand-written `extern "C"` block over include/tdist/c/tdist.h, the
// binding's own ops from tests/c/binding_ops.h (tch-rs would use its
// Tensor and pass `as_mut_ptr()`). DDP and FSDP at the world size
// tdist-run gives, each compared bit for bit with tdist's C++ API
// training the same model (tt_reference). Built by rustc alone (no crates;
// Debian's rustc 1.63), run by ctest under tdist-run.
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_void};
use std::process::exit;
use std::ptr;

type Tensor = *mut c_void; // an at::Tensor*
#[repr(C)]
struct Opaque {
    _private: [u8; 0],
}
type Pg = *mut Opaque;
type Module = *mut Opaque;
type Ddp = *mut Opaque;
type Fsdp = *mut Opaque;
type List = *mut Opaque;

const TDIST_OK: c_int = 0;
const TDIST_ERR_USAGE: c_int = 1;
const TDIST_C_ABI_VERSION: c_int = 1;
const NPARAMS: usize = 4;
const STEPS: c_int = 6;
const LR: f64 = 0.05;

#[repr(C)]
struct FsdpOptions {
    struct_size: usize,
    sharding_strategy: c_int,
    reshard_after_forward: c_int,
    param_dtype: c_int,
    reduce_dtype: c_int,
    buffer_dtype: c_int,
    cast_forward_inputs: c_int,
    backward_prefetch: c_int,
    forward_prefetch: c_int,
    sync_module_states: c_int,
    hybrid_shard_size: c_int,
}

#[link(name = "tdist_c")]
extern "C" {
    fn tdist_last_error() -> *const c_char;
    fn tdist_torch_version() -> *const c_char;
    fn tdist_check_abi(abi: c_int, torch_version: *const c_char) -> c_int;
    fn tdist_init_process_group(backend: *const c_char, timeout_ms: i64, out: *mut Pg) -> c_int;
    fn tdist_pg_rank(pg: Pg, out: *mut c_int) -> c_int;
    fn tdist_pg_free(pg: Pg) -> c_int;
    fn tdist_all_reduce(pg: Pg, t: Tensor, op: c_int, timeout_ms: i64) -> c_int;
    fn tdist_module_new(names: *const *const c_char, params: *const Tensor, n: usize, out: *mut Module) -> c_int;
    fn tdist_module_free(m: Module) -> c_int;
    fn tdist_ddp_new(m: Module, pg: Pg, o: *const c_void, out: *mut Ddp) -> c_int;
    fn tdist_ddp_pre_forward(d: Ddp) -> c_int;
    fn tdist_ddp_post_forward(d: Ddp, outputs: *const Tensor, n: usize) -> c_int;
    fn tdist_ddp_free(d: Ddp) -> c_int;
    fn tdist_fsdp_options_init(o: *mut FsdpOptions);
    fn tdist_fully_shard(m: Module, path: *const c_char, pg: Pg, o: *const FsdpOptions, out: *mut Fsdp) -> c_int;
    fn tdist_fsdp_pre_forward(u: Fsdp) -> c_int;
    fn tdist_fsdp_post_forward(u: Fsdp, outputs: *const Tensor, n: usize) -> c_int;
    fn tdist_fsdp_free(u: Fsdp) -> c_int;
    fn tdist_full_state_dict(m: Module, rank0_only: c_int, out: *mut List) -> c_int;
    fn tdist_tensor_list_size(l: List, n: *mut usize) -> c_int;
    fn tdist_tensor_list_get(l: List, i: usize, name: *mut *const c_char, t: *mut Tensor) -> c_int;
    fn tdist_tensor_list_free(l: List) -> c_int;
}

#[link(name = "tdist_c_testops")]
extern "C" {
    static tt_names: [*const c_char; NPARAMS];
    fn tt_init_params(rank: c_int, out: *mut Tensor) -> c_int;
    fn tt_step_batch(rank: c_int, step: c_int, x: *mut Tensor, target: *mut Tensor) -> c_int;
    fn tt_linear(x: Tensor, w: Tensor, b: Tensor) -> Tensor;
    fn tt_tanh(x: Tensor) -> Tensor;
    fn tt_mse(y: Tensor, target: Tensor) -> Tensor;
    fn tt_backward(loss: Tensor) -> c_int;
    fn tt_sgd_step(params: *const Tensor, n: usize, lr: f64) -> c_int;
    fn tt_equal(a: Tensor, b: Tensor) -> c_int;
    fn tt_free(t: Tensor);
    fn tt_reference(mode: *const c_char, steps: c_int, lr: f64, out: *mut Tensor) -> c_int;
}

struct Run {
    rank: c_int,
}

impl Run {
    fn ok(&self, status: c_int, what: &str) {
        if status != TDIST_OK {
            let msg = unsafe { CStr::from_ptr(tdist_last_error()) }.to_string_lossy().into_owned();
            eprintln!("rank {}: FAILED: {} (status {}: {})", self.rank, what, status, msg);
            exit(1);
        }
    }
    fn check(&self, ok: bool, what: &str) {
        if !ok {
            eprintln!("rank {}: FAILED: {}", self.rank, what);
            exit(1);
        }
    }
    fn some(&self, t: Tensor, what: &str) -> Tensor {
        self.check(!t.is_null(), what);
        t
    }

    // Step s's forward (the hooks given around it) and backward.
    fn forward_backward(&self, p: &[Tensor; NPARAMS], s: c_int, ddp: Ddp, units: Option<&[Fsdp; 3]>) {
        unsafe {
            let (mut x, mut target) = (ptr::null_mut(), ptr::null_mut());
            self.check(tt_step_batch(self.rank, s, &mut x, &mut target) == 0, "tt_step_batch");
            if !ddp.is_null() {
                self.ok(tdist_ddp_pre_forward(ddp), "tdist_ddp_pre_forward");
            }
            if let Some(u) = units {
                self.ok(tdist_fsdp_pre_forward(u[2]), "root pre_forward");
                self.ok(tdist_fsdp_pre_forward(u[0]), "fc1 pre_forward");
            }
            let h = self.some(tt_linear(x, p[0], p[1]), "fc1");
            if let Some(u) = units {
                self.ok(tdist_fsdp_post_forward(u[0], &h, 1), "fc1 post_forward");
            }
            let a = self.some(tt_tanh(h), "tanh");
            if let Some(u) = units {
                self.ok(tdist_fsdp_pre_forward(u[1]), "fc2 pre_forward");
            }
            let y = self.some(tt_linear(a, p[2], p[3]), "fc2");
            if let Some(u) = units {
                self.ok(tdist_fsdp_post_forward(u[1], &y, 1), "fc2 post_forward");
                self.ok(tdist_fsdp_post_forward(u[2], &y, 1), "root post_forward");
            }
            if !ddp.is_null() {
                self.ok(tdist_ddp_post_forward(ddp, &y, 1), "tdist_ddp_post_forward");
            }
            let loss = self.some(tt_mse(y, target), "mse");
            self.check(tt_backward(loss) == 0, "backward");
            for t in [loss, y, a, h, x, target] {
                tt_free(t);
            }
        }
    }

    fn compare(&self, mode: &str, mine: &[Tensor; NPARAMS]) {
        let mut reference: [Tensor; NPARAMS] = [ptr::null_mut(); NPARAMS];
        let m = CString::new(mode).unwrap();
        unsafe {
            self.check(tt_reference(m.as_ptr(), STEPS, LR, reference.as_mut_ptr()) == 0, "tt_reference");
            for i in 0..NPARAMS {
                let name = CStr::from_ptr(tt_names[i]).to_string_lossy();
                self.check(tt_equal(mine[i], reference[i]) == 1,
                           &format!("{}: {} equals the C++ API's bit for bit", mode, name));
                tt_free(reference[i]);
            }
        }
    }

    fn params(&self) -> [Tensor; NPARAMS] {
        let mut p: [Tensor; NPARAMS] = [ptr::null_mut(); NPARAMS];
        self.check(unsafe { tt_init_params(self.rank, p.as_mut_ptr()) } == 0, "tt_init_params");
        p
    }

    fn module(&self, p: &[Tensor; NPARAMS]) -> Module {
        let mut m: Module = ptr::null_mut();
        self.ok(unsafe { tdist_module_new(tt_names.as_ptr(), p.as_ptr(), NPARAMS, &mut m) }, "tdist_module_new");
        m
    }

    fn ddp(&self) {
        let p = self.params();
        let m = self.module(&p);
        let mut ddp: Ddp = ptr::null_mut();
        unsafe {
            self.ok(tdist_ddp_new(m, ptr::null_mut(), ptr::null(), &mut ddp), "tdist_ddp_new");
            for s in 0..STEPS {
                self.forward_backward(&p, s, ddp, None);
                self.check(tt_sgd_step(p.as_ptr(), NPARAMS, LR) == 0, "sgd");
            }
            self.compare("ddp", &p);
            self.ok(tdist_ddp_free(ddp), "tdist_ddp_free");
            self.check(tdist_ddp_free(ddp) == TDIST_ERR_USAGE, "a freed DDP handle is a usage error");
            self.ok(tdist_module_free(m), "tdist_module_free");
            for t in p {
                tt_free(t);
            }
        }
    }

    fn fsdp(&self) {
        let p = self.params();
        let m = self.module(&p);
        let mut units: [Fsdp; 3] = [ptr::null_mut(); 3];
        let mut o: FsdpOptions = unsafe { std::mem::zeroed() };
        unsafe {
            tdist_fsdp_options_init(&mut o);
            for (i, path) in ["fc1", "fc2", ""].iter().enumerate() {
                let c = CString::new(*path).unwrap();
                self.ok(tdist_fully_shard(m, c.as_ptr(), ptr::null_mut(), &o, &mut units[i]), "tdist_fully_shard");
            }
            for s in 0..STEPS {
                self.forward_backward(&p, s, ptr::null_mut(), Some(&units));
                self.check(tt_sgd_step(p.as_ptr(), NPARAMS, LR) == 0, "sgd");
            }
            let mut list: List = ptr::null_mut();
            self.ok(tdist_full_state_dict(m, 0, &mut list), "tdist_full_state_dict");
            let mut n = 0usize;
            self.ok(tdist_tensor_list_size(list, &mut n), "tdist_tensor_list_size");
            self.check(n == NPARAMS, "the full state dict has 4 tensors");
            let mut whole: [Tensor; NPARAMS] = [ptr::null_mut(); NPARAMS];
            for k in 0..n {
                let (mut name, mut t): (*const c_char, Tensor) = (ptr::null(), ptr::null_mut());
                self.ok(tdist_tensor_list_get(list, k, &mut name, &mut t), "tdist_tensor_list_get");
                for i in 0..NPARAMS {
                    if CStr::from_ptr(name) == CStr::from_ptr(tt_names[i]) {
                        whole[i] = t;
                    }
                }
            }
            self.check(whole.iter().all(|t| !t.is_null()), "every parameter is in the state dict");
            self.compare("fsdp", &whole);
            self.ok(tdist_tensor_list_free(list), "tdist_tensor_list_free");
            for u in units {
                self.ok(tdist_fsdp_free(u), "tdist_fsdp_free");
            }
            self.ok(tdist_module_free(m), "tdist_module_free");
            for t in p {
                tt_free(t);
            }
        }
    }
}

fn main() {
    let mut run = Run { rank: -1 };
    let mut pg: Pg = ptr::null_mut();
    let backend = CString::new("auto").unwrap();
    unsafe {
        run.ok(tdist_check_abi(TDIST_C_ABI_VERSION, tdist_torch_version()), "tdist_check_abi");
        run.ok(tdist_init_process_group(backend.as_ptr(), 60_000, &mut pg), "tdist_init_process_group");
        let mut rank: c_int = -1;
        run.ok(tdist_pg_rank(pg, &mut rank), "tdist_pg_rank");
        run.rank = rank;
        // Misuse returns an error, never a crash: a null tensor.
        run.check(tdist_all_reduce(pg, ptr::null_mut(), 0, 60_000) == TDIST_ERR_USAGE, "a null tensor is refused");
    }
    run.ddp();
    run.fsdp();
    run.ok(unsafe { tdist_pg_free(pg) }, "tdist_pg_free");
    println!("rank {}: rust c_api_train ok", run.rank);
}
