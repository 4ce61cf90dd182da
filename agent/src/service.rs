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

#[cfg(test)]
mod tests {
    use super::*;

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
}
