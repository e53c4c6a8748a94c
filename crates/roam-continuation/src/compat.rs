//! Compatibility vectors (paper §IV-E, `register_compat_vector` /
//! `compat_store`): a service registers properties, a continuation records
//! what it requires, and a resume is refused where they disagree.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::Incompatible;
use crate::record::Body;
use crate::service::Service;

/// Checks a continuation of `service` against this host's registry. The
/// first unmet requirement (in name order) is the one reported.
pub(crate) fn check(
    services: &HashMap<String, Arc<Service>>,
    service: &str,
    body: &Body,
) -> Result<(), Incompatible> {
    let Some(svc) = services.get(service) else {
        return Err(Incompatible::UnknownService(service.to_string()));
    };
    if !svc.routines.contains_key(&body.routine) {
        return Err(Incompatible::UnknownRoutine {
            service: service.to_string(),
            routine: body.routine.clone(),
        });
    }
    for (property, required) in &body.requires {
        let found = svc.properties.get(property);
        if found != Some(required) {
            return Err(Incompatible::Mismatch {
                service: service.to_string(),
                property: property.clone(),
                required: required.clone(),
                found: found.cloned(),
            });
        }
    }
    Ok(())
}
