//! A memory budget that follows the machine's free memory (`--adapt-budget`): a watchdog thread
//! reads how much memory is available to the process (its cgroup's limit less its working set,
//! and the kernel's `MemAvailable`), lowers the budget when that falls below a low mark and
//! raises it back toward the user's budget when memory is free again
//! ([`super::stream::BudgetControl::set`]: the expert cache shrinks or grows, the output does
//! not change). On iOS an app calls `les_set_memory_budget` from its memory-warning handler
//! instead (the C ABI); in the browser the page does (`engine.setMemoryBudget`).

use super::stream::BudgetControl;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// When to shrink and grow. Free memory below `low` shrinks the budget by what is missing up
/// to `2 × low` (so one step makes room for a while); above `high` it grows back by what is
/// free beyond `2 × low`, never past the user's budget. `low < 2·low < high` keeps the two
/// apart (no oscillation between polls).
#[derive(Clone, Copy, Debug)]
pub struct AdaptRule {
    /// The user's budget: the most the watchdog gives back.
    pub target: u64,
    /// The model's minimum: the least it leaves.
    pub minimum: u64,
    /// Free bytes below which the budget shrinks.
    pub low: u64,
    /// Free bytes above which the budget grows.
    pub high: u64,
}

impl AdaptRule {
    /// The default marks for a budget `target`: `low` = max(64 MiB, 5% of it), `high` = 4 × low.
    pub fn for_budget(target: u64, minimum: u64) -> Self {
        let low = (64u64 << 20).max(target / 20);
        Self { target, minimum, low, high: 4 * low }
    }

    /// The budget to set given the budget now and the free memory (`None`: leave it).
    pub fn next(&self, budget: u64, free: u64) -> Option<u64> {
        let want = if free < self.low {
            budget.saturating_sub(2 * self.low - free).max(self.minimum)
        } else if free > self.high && budget < self.target {
            (budget + (free - 2 * self.low)).min(self.target)
        } else {
            return None;
        };
        (want != budget).then_some(want)
    }
}

/// Bytes of memory the process may still take: the least of the kernel's `MemAvailable` and,
/// in a memory cgroup with a limit, the limit less the cgroup's working set (usage less its
/// inactive file pages, which the kernel reclaims first: the figure `docker stats` and the
/// kubelet use). cgroup v2 (`memory.max`, `memory.current`, `memory.stat` `inactive_file`) and v1
/// (`memory.limit_in_bytes`, `memory.usage_in_bytes`, `total_inactive_file`). `None` where none of
/// these can be read (not Linux).
pub fn available_memory() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let mem_available = read("/proc/meminfo").and_then(|s| meminfo_available(&s));
    let cgroup = read("/proc/self/cgroup").and_then(|s| cgroup_free(&s, &|p| read(p)));
    match (mem_available, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` of `/proc/meminfo` in bytes.
fn meminfo_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Free bytes in the process's memory cgroup (`proc_cgroup`: `/proc/self/cgroup`), reading the
/// controller's files through `read`; `None` without a limit.
fn cgroup_free(proc_cgroup: &str, read: &dyn Fn(&str) -> Option<String>) -> Option<u64> {
    let num = |s: Option<String>| s.and_then(|s| s.trim().parse::<u64>().ok());
    let stat = |s: Option<String>, key: &str| s.and_then(|s| s.lines().find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse::<u64>().ok())));
    for line in proc_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        let path = path.trim_end_matches('/');
        if ctrl.is_empty() {
            // v2 (the unified hierarchy); "max" means no limit.
            let dir = format!("/sys/fs/cgroup{path}");
            if let Some(limit) = num(read(&format!("{dir}/memory.max"))) {
                let used = num(read(&format!("{dir}/memory.current")))?;
                let inactive = stat(read(&format!("{dir}/memory.stat")), "inactive_file ").unwrap_or(0);
                return Some(limit.saturating_sub(used.saturating_sub(inactive)));
            }
        } else if ctrl.split(',').any(|c| c == "memory") {
            let dir = format!("/sys/fs/cgroup/memory{path}");
            let limit = num(read(&format!("{dir}/memory.limit_in_bytes")))?;
            // An unlimited v1 group reports a page-rounded i64::MAX.
            if limit >= 1 << 60 {
                return None;
            }
            let used = num(read(&format!("{dir}/memory.usage_in_bytes")))?;
            let inactive = stat(read(&format!("{dir}/memory.stat")), "total_inactive_file ").unwrap_or(0);
            return Some(limit.saturating_sub(used.saturating_sub(inactive)));
        }
    }
    None
}

/// The running watchdog; dropping it stops the thread.
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    /// Poll `free` every `every` and apply `rule` through `ctl`; `log` hears each change
    /// (old, new budget, free bytes).
    pub fn spawn(ctl: BudgetControl, rule: AdaptRule, every: Duration, free: impl Fn() -> Option<u64> + Send + 'static, log: impl Fn(u64, u64, u64) + Send + 'static) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new().name("les-adapt-budget".into()).spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                if let Some(f) = free() {
                    let now = ctl.budget();
                    if let Some(b) = rule.next(now, f) {
                        if ctl.set(b).is_ok() {
                            log(now, b, f);
                        }
                    }
                }
                std::thread::park_timeout(every);
            }
        })?;
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn shrinks_below_low_grows_above_high_and_stays_between() {
        let r = AdaptRule { target: 1000 * MIB, minimum: 300 * MIB, low: 64 * MIB, high: 256 * MIB };
        // 40 MiB free: give back the 88 MiB missing to 2 × low.
        assert_eq!(r.next(1000 * MIB, 40 * MIB), Some(912 * MIB));
        // Never below the minimum; at the minimum nothing more to give.
        assert_eq!(r.next(320 * MIB, 0), Some(300 * MIB));
        assert_eq!(r.next(300 * MIB, 0), None);
        // Between the marks: leave it.
        assert_eq!(r.next(700 * MIB, 64 * MIB), None);
        assert_eq!(r.next(700 * MIB, 256 * MIB), None);
        // Free again: grow by what is free beyond 2 × low, up to the user's budget.
        assert_eq!(r.next(700 * MIB, 300 * MIB), Some(872 * MIB));
        assert_eq!(r.next(900 * MIB, 2000 * MIB), Some(1000 * MIB));
        assert_eq!(r.next(1000 * MIB, 2000 * MIB), None);
        // A grow never leaves less than 2 × low free, so the next poll does not shrink it back.
        let (b, free) = (700 * MIB, 300 * MIB);
        let nb = r.next(b, free).unwrap();
        assert_eq!(r.next(nb, free - (nb - b)), None);
        // Default marks.
        let d = AdaptRule::for_budget(4096 * MIB, 0);
        assert_eq!((d.low, d.high), (4096 * MIB / 20, 4 * (4096 * MIB / 20)));
        assert_eq!(AdaptRule::for_budget(256 * MIB, 0).low, 64 * MIB);
    }

    #[test]
    fn reads_cgroup_v1_and_v2_and_meminfo() {
        // /proc/meminfo and the cgroup files as the kernel writes them (proc(5), cgroup-v1
        // memory.txt, cgroup-v2.rst).
        assert_eq!(meminfo_available("MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   2048 kB\n"), Some(2048 * 1024));
        let files = |m: &'static [(&'static str, &'static str)]| move |p: &str| m.iter().find(|x| x.0 == p).map(|x| x.1.to_string());
        let v2 = files(&[
            ("/sys/fs/cgroup/app/memory.max", "1073741824\n"),
            ("/sys/fs/cgroup/app/memory.current", "805306368\n"),
            ("/sys/fs/cgroup/app/memory.stat", "anon 600000000\nfile 200000000\nactive_file 100\ninactive_file 104857600\n"),
        ]);
        assert_eq!(cgroup_free("0::/app\n", &v2), Some(1073741824 - (805306368 - 104857600)));
        let v2_unlimited = files(&[("/sys/fs/cgroup/app/memory.max", "max\n"), ("/sys/fs/cgroup/app/memory.current", "5\n")]);
        assert_eq!(cgroup_free("0::/app\n", &v2_unlimited), None);
        let v1 = files(&[
            ("/sys/fs/cgroup/memory/job/memory.limit_in_bytes", "536870912\n"),
            ("/sys/fs/cgroup/memory/job/memory.usage_in_bytes", "500000000\n"),
            ("/sys/fs/cgroup/memory/job/memory.stat", "cache 1\ninactive_file 7\ntotal_inactive_file 100000000\n"),
        ]);
        assert_eq!(cgroup_free("9:pids:/\n4:memory:/job\n0::/\n", &v1), Some(536870912 - (500000000 - 100000000)));
        let v1_unlimited = files(&[("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n"), ("/sys/fs/cgroup/memory/memory.usage_in_bytes", "1\n")]);
        assert_eq!(cgroup_free("4:memory:/\n", &v1_unlimited), None);
    }
}
