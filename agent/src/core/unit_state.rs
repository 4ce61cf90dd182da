//! What systemd says a service is doing, typed: parsed once where it is read, matched as values
//! everywhere else. Pure.

/// A unit's `ActiveState`, parsed once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ActiveState {
    Active,
    Reloading,
    Inactive,
    Failed,
    Activating,
    Deactivating,
    Maintenance,
    Refreshing,
    /// Not told (systemd could not be asked) or a state this specd does not know.
    #[default]
    Unknown,
}

impl ActiveState {
    pub fn parse(s: &str) -> ActiveState {
        match s {
            "active" => ActiveState::Active,
            "reloading" => ActiveState::Reloading,
            "inactive" => ActiveState::Inactive,
            "failed" => ActiveState::Failed,
            "activating" => ActiveState::Activating,
            "deactivating" => ActiveState::Deactivating,
            "maintenance" => ActiveState::Maintenance,
            "refreshing" => ActiveState::Refreshing,
            _ => ActiveState::Unknown,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ActiveState::Active => "active",
            ActiveState::Reloading => "reloading",
            ActiveState::Inactive => "inactive",
            ActiveState::Failed => "failed",
            ActiveState::Activating => "activating",
            ActiveState::Deactivating => "deactivating",
            ActiveState::Maintenance => "maintenance",
            ActiveState::Refreshing => "refreshing",
            ActiveState::Unknown => "unknown",
        }
    }

    /// The service is up or coming up: not down.
    pub fn is_up(self) -> bool {
        matches!(self, ActiveState::Active | ActiveState::Activating | ActiveState::Reloading | ActiveState::Refreshing)
    }

    /// A process of the unit may be alive (up, or stopping).
    pub fn may_run(self) -> bool {
        self.is_up() || self == ActiveState::Deactivating
    }

    /// Stopped, cleanly or not.
    pub fn is_stopped(self) -> bool {
        matches!(self, ActiveState::Inactive | ActiveState::Failed)
    }
}

impl From<&str> for ActiveState {
    fn from(s: &str) -> ActiveState {
        ActiveState::parse(s)
    }
}

impl std::fmt::Display for ActiveState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A unit's `LoadState`, parsed once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LoadState {
    Stub,
    Loaded,
    NotFound,
    BadSetting,
    Error,
    Merged,
    Masked,
    /// Not told, or a state this specd does not know.
    #[default]
    Unknown,
}

impl LoadState {
    const ALL: [LoadState; 8] = [
        LoadState::Stub,
        LoadState::Loaded,
        LoadState::NotFound,
        LoadState::BadSetting,
        LoadState::Error,
        LoadState::Merged,
        LoadState::Masked,
        LoadState::Unknown,
    ];

    pub fn parse(s: &str) -> LoadState {
        LoadState::ALL.into_iter().find(|l| l.as_str() == s).unwrap_or(LoadState::Unknown)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            LoadState::Stub => "stub",
            LoadState::Loaded => "loaded",
            LoadState::NotFound => "not-found",
            LoadState::BadSetting => "bad-setting",
            LoadState::Error => "error",
            LoadState::Merged => "merged",
            LoadState::Masked => "masked",
            LoadState::Unknown => "unknown",
        }
    }
}

impl std::fmt::Display for LoadState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A unit's `UnitFileState` (whether and how it starts at boot), parsed once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum UnitFileState {
    Enabled,
    EnabledRuntime,
    Linked,
    LinkedRuntime,
    Alias,
    Masked,
    MaskedRuntime,
    Static,
    Disabled,
    Indirect,
    Generated,
    Transient,
    Bad,
    /// Empty (a unit systemd does not know) or a state this specd does not know.
    #[default]
    #[serde(rename = "")]
    Unknown,
}

impl UnitFileState {
    const ALL: [UnitFileState; 14] = [
        UnitFileState::Enabled,
        UnitFileState::EnabledRuntime,
        UnitFileState::Linked,
        UnitFileState::LinkedRuntime,
        UnitFileState::Alias,
        UnitFileState::Masked,
        UnitFileState::MaskedRuntime,
        UnitFileState::Static,
        UnitFileState::Disabled,
        UnitFileState::Indirect,
        UnitFileState::Generated,
        UnitFileState::Transient,
        UnitFileState::Bad,
        UnitFileState::Unknown,
    ];

    pub fn parse(s: &str) -> UnitFileState {
        UnitFileState::ALL.into_iter().find(|u| u.as_str() == s).unwrap_or(UnitFileState::Unknown)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            UnitFileState::Enabled => "enabled",
            UnitFileState::EnabledRuntime => "enabled-runtime",
            UnitFileState::Linked => "linked",
            UnitFileState::LinkedRuntime => "linked-runtime",
            UnitFileState::Alias => "alias",
            UnitFileState::Masked => "masked",
            UnitFileState::MaskedRuntime => "masked-runtime",
            UnitFileState::Static => "static",
            UnitFileState::Disabled => "disabled",
            UnitFileState::Indirect => "indirect",
            UnitFileState::Generated => "generated",
            UnitFileState::Transient => "transient",
            UnitFileState::Bad => "bad",
            UnitFileState::Unknown => "",
        }
    }

    /// A mask, in /etc or /run.
    pub fn is_mask(self) -> bool {
        matches!(self, UnitFileState::Masked | UnitFileState::MaskedRuntime)
    }
}

impl std::fmt::Display for UnitFileState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A closed list of systemd's words for one property, as an enum with [`Other`] for a word this
/// specd does not know (a newer systemd's, another unit type's), kept as systemd wrote it: parsed
/// once where it is read, printed and serialized back exactly.
macro_rules! systemd_words {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $s:literal,)* }) => {
        $(#[$m])*
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vm])* $v,)*
            /// A word this specd does not know, as systemd wrote it (empty: not told).
            Other(String),
        }

        impl $name {
            /// Every word this specd knows.
            pub const KNOWN: &[$name] = &[$($name::$v,)*];

            pub fn parse(s: &str) -> $name {
                match s {
                    $($s => $name::$v,)*
                    other => $name::Other(other.to_string()),
                }
            }

            pub fn as_str(&self) -> &str {
                match self {
                    $($name::$v => $s,)*
                    $name::Other(s) => s,
                }
            }

            /// Not told (systemd could not be asked, or has no value).
            pub fn is_empty(&self) -> bool {
                self.as_str().is_empty()
            }
        }

        impl Default for $name {
            fn default() -> $name {
                $name::Other(String::new())
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> $name {
                $name::parse(s)
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
    };
}

systemd_words! {
    /// A service's `SubState` (systemd's `service_state_table`), parsed once.
    SubState {
        Dead = "dead",
        Condition = "condition",
        StartPre = "start-pre",
        Start = "start",
        StartPost = "start-post",
        Running = "running",
        Exited = "exited",
        Reload = "reload",
        ReloadSignal = "reload-signal",
        ReloadNotify = "reload-notify",
        Stop = "stop",
        StopWatchdog = "stop-watchdog",
        StopSigterm = "stop-sigterm",
        StopSigkill = "stop-sigkill",
        StopPost = "stop-post",
        FinalWatchdog = "final-watchdog",
        FinalSigterm = "final-sigterm",
        FinalSigkill = "final-sigkill",
        Failed = "failed",
        DeadBeforeAutoRestart = "dead-before-auto-restart",
        FailedBeforeAutoRestart = "failed-before-auto-restart",
        DeadResourcesPinned = "dead-resources-pinned",
        /// Waiting for `RestartSec=` before systemd starts it again.
        AutoRestart = "auto-restart",
        AutoRestartQueued = "auto-restart-queued",
        Cleaning = "cleaning",
    }
}

systemd_words! {
    /// A service's `Result` (how its last run ended: systemd's `service_result_table`), parsed
    /// once.
    ServiceResult {
        Success = "success",
        Resources = "resources",
        Protocol = "protocol",
        /// A start, stop or runtime timeout (a stop's ends in SIGKILL).
        Timeout = "timeout",
        ExitCode = "exit-code",
        /// Killed by a signal it did not handle.
        Signal = "signal",
        CoreDump = "core-dump",
        Watchdog = "watchdog",
        StartLimitHit = "start-limit-hit",
        OomKill = "oom-kill",
        SkipCondition = "skip-condition",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_and_unit_file_states_read_as_systemd_writes_them() {
        for l in LoadState::ALL {
            assert_eq!(LoadState::parse(l.as_str()), l);
            assert_eq!(serde_json::to_string(&l).unwrap(), format!("\"{}\"", l.as_str()));
        }
        for u in UnitFileState::ALL.into_iter().filter(|u| *u != UnitFileState::Unknown) {
            assert_eq!(UnitFileState::parse(u.as_str()), u);
            assert_eq!(serde_json::to_string(&u).unwrap(), format!("\"{}\"", u.as_str()));
        }
        assert_eq!(LoadState::parse("frobnicated"), LoadState::Unknown);
        assert_eq!(UnitFileState::parse(""), UnitFileState::Unknown);
        assert!(UnitFileState::MaskedRuntime.is_mask() && !UnitFileState::Enabled.is_mask());
    }

    #[test]
    fn every_state_systemd_names_reads_back_and_anything_else_is_unknown() {
        for s in
            ["active", "reloading", "inactive", "failed", "activating", "deactivating", "maintenance", "refreshing"]
        {
            assert_eq!(ActiveState::parse(s).as_str(), s);
        }
        assert_eq!(ActiveState::parse(""), ActiveState::Unknown);
        assert_eq!(ActiveState::parse("Active"), ActiveState::Unknown);
        // Down is what `status`, the verdict and the metric call it: not up and not coming up.
        let up: Vec<_> = ["active", "reloading", "activating", "refreshing"].map(ActiveState::parse).to_vec();
        for s in ["inactive", "failed", "deactivating", "maintenance", ""].map(ActiveState::parse) {
            assert!(!s.is_up() && !up.contains(&s), "{s}");
        }
        assert!(up.iter().all(|s| s.is_up() && s.may_run()));
        assert!(ActiveState::Deactivating.may_run());
    }

    #[test]
    fn sub_states_and_results_read_back_as_written_and_an_unknown_word_is_kept() {
        for s in SubState::KNOWN {
            assert_eq!(&SubState::parse(s.as_str()), s);
            assert_eq!(serde_json::to_string(s).unwrap(), format!("\"{s}\""));
        }
        for r in ServiceResult::KNOWN {
            assert_eq!(&ServiceResult::parse(r.as_str()), r);
        }
        assert_eq!(SubState::parse("stop-sigterm"), SubState::StopSigterm);
        assert_eq!(ServiceResult::parse("oom-kill"), ServiceResult::OomKill);
        // A word of a newer systemd, or of another unit type, is kept and printed as it was.
        let new = SubState::parse("frobnicating");
        assert_eq!(
            (new.to_string(), serde_json::to_string(&new).unwrap()),
            ("frobnicating".into(), "\"frobnicating\"".into())
        );
        assert_eq!(ServiceResult::parse("exec-condition"), ServiceResult::Other("exec-condition".into()));
        assert!(SubState::default().is_empty() && ServiceResult::parse("").is_empty());
        assert!(!ServiceResult::Success.is_empty());
    }
}
