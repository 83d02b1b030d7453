//! The foreign calls of the tests: a seccomp filter that makes Cross Memory Attach fail with
//! `EPERM`, as a locked-down container or a Yama `ptrace_scope` would.

#![allow(unsafe_code)]

use std::io;

/// Which Cross Memory Attach calls the filter refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmaBlock {
    /// Every `process_vm_readv` / `process_vm_writev`: even reading this process's own
    /// memory fails (a seccomp profile that lists neither call).
    All,
    /// Only calls naming another process: this process may read itself, not its peers
    /// (what Yama `ptrace_scope` 1–3 does between siblings).
    OtherProcesses,
}

/// `AUDIT_ARCH_*` of this target (the filter checks it before trusting syscall numbers).
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;

const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
/// Offsets in `struct seccomp_data`: nr (u32), arch (u32), ip (u64), args[6] (u64 each).
const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
/// Low 32 bits of `args[0]` (little-endian): the pid of both CMA calls.
const OFF_ARG0_LO: u32 = 16;

fn stmt(code: u16, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter {
        code: JEQ_K,
        jt,
        jf,
        k,
    }
}

/// The BPF program: allow everything except the CMA calls `block` names, which return
/// `EPERM`. Jumps count the instructions skipped after the current one.
fn program(block: CmaBlock, own_pid: u32) -> Vec<libc::sock_filter> {
    let deny = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    let allow = libc::SECCOMP_RET_ALLOW;
    let readv = libc::SYS_process_vm_readv as u32;
    let writev = libc::SYS_process_vm_writev as u32;
    match block {
        CmaBlock::All => vec![
            stmt(LD_W_ABS, OFF_ARCH),
            jump(AUDIT_ARCH, 0, 3), // foreign arch: allow
            stmt(LD_W_ABS, OFF_NR),
            jump(readv, 2, 0),  // deny
            jump(writev, 1, 0), // deny
            stmt(RET_K, allow),
            stmt(RET_K, deny),
        ],
        CmaBlock::OtherProcesses => vec![
            stmt(LD_W_ABS, OFF_ARCH),
            jump(AUDIT_ARCH, 0, 5), // foreign arch: allow
            stmt(LD_W_ABS, OFF_NR),
            jump(readv, 1, 0),  // check the pid
            jump(writev, 0, 2), // not CMA: allow
            stmt(LD_W_ABS, OFF_ARG0_LO),
            jump(own_pid, 0, 1), // own pid: allow, else deny
            stmt(RET_K, allow),
            stmt(RET_K, deny),
        ],
    }
}

/// Install the filter on every thread of this process (`PR_SET_NO_NEW_PRIVS`, then
/// `seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC)`). Irreversible: call it only
/// in a child process started for the purpose.
pub fn forbid_cma(block: CmaBlock) -> io::Result<()> {
    let mut prog = program(block, std::process::id());
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments only and touches no memory.
    let r = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fprog` points to `prog`, a live array of `len` instructions, for the duration
    // of the call (the kernel copies the program); the other arguments are integers.
    let r = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_TSYNC,
            &fprog as *const libc::sock_fprog,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
